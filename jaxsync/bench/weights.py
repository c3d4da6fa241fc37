"""Benchmark of ``weights=`` with even inputs: ``python -m jaxsync bench --suite weights``.

What ``weights=True`` costs a run whose replicas all have full batches (weight 1,
``done=False``), in the train step docs/strategies.md writes (forward, backward,
``optax.chain(mean, sgd).update(grads, state, params, weight=w, done=d)``, one
jitted function, parameters and state donated) of the overlap suite's layer stack
(``--layers`` x ``--width``, batch ``--batch``), one device per process: the step
with ``hierarchical_mean`` with and without ``weights=True``, on a float32 wire and
on a bfloat16 one (where the weights travel in a small float32 synchronisation of
their own), beside the step without synchronisation (``compute``) and the bare
``sync_gradients`` of the gradients (``sync``). Timed in interleaved rounds (each
sample the median of ``--iters`` steps, the slowest rank's; the figure the median
over rounds); the weighted step's result is checked equal to the plain one's.

Target (issue 43): with even inputs the cost of ``weights=`` is at most 2 % of the
sync: ``(weights - plain) / sync <= 0.02`` per wire. Run it under ``mpirun -n 2``
and on the emulated cluster (``python -m jaxsync cluster --hosts 2
--procs-per-host 1 --link 100mbit -- python -m jaxsync bench --suite weights``);
without MPI it runs in one process (no wire: a smoke run). Writes
``weights-<mode>.json`` to ``--out``. Figures on a shared machine are noisy: read
ratios from one run.

What it may import: numpy, jax, optax, mpi4py, ``jaxsync`` (public API) and the
other ``jaxsync.bench`` modules.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from .compress import _time
from .overlap import loss, make_params

WIRES = {"float32": None, "bfloat16": "bfloat16"}


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m jaxsync bench --suite weights")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    return p.parse_args(argv)


def measure(comm, layers: int, width: int, batch: int, rounds: int, iters: int):
    """Median seconds per step of each case (``compute``, ``<wire>/plain``,
    ``<wire>/weights``) and of the bare ``sync``; per wire whether the weighted
    step's parameters equal the plain step's bitwise (weight 1: they must)."""
    import jax
    import jax.numpy as jnp
    import optax

    import jaxsync

    rank = 0 if comm is None else comm.Get_rank()
    params = make_params(layers, width)
    x = jax.random.normal(jax.random.PRNGKey(1 + rank), (batch, width))
    w, d = jnp.float32(1), jnp.bool_(False)
    run, first = {}, {}

    def case(name, tx, weighted):
        opt = optax.sgd(1e-2) if tx is None else optax.chain(tx, optax.sgd(1e-2))
        extra = {"weight": w, "done": d} if weighted else {}

        def body(p, s, x):  # as docs/strategies.md writes the step
            g = jax.grad(loss)(p, x)
            u, s = opt.update(g, s, p, **extra)
            return optax.apply_updates(p, u), s

        step = jax.jit(body, donate_argnums=(0, 1))
        carry = [jax.tree.map(jnp.copy, params)]
        carry.append(opt.init(carry[0]))
        first[name] = step(jax.tree.map(jnp.copy, params), opt.init(params), x)[0]

        def go():
            carry[:] = step(carry[0], carry[1], x)
            jax.block_until_ready(carry)

        go()  # compile
        run[name] = go

    case("compute", None, False)
    for wire, dtype in WIRES.items():
        for weighted in (False, True):
            tx = jaxsync.hierarchical_mean(None, comm, comm_dtype=dtype, weights=weighted)
            case(f"{wire}/{'weights' if weighted else 'plain'}", tx, weighted)
    sync = jax.jit(lambda g: jaxsync.sync_gradients(g, axis_name=None, comm=comm))
    grads = jax.grad(loss)(params, x)
    run["sync"] = lambda: jax.block_until_ready(sync(grads))
    run["sync"]()
    same = {
        wire: all(
            bool(jnp.array_equal(a, b))
            for a, b in zip(
                jax.tree.leaves(first[f"{wire}/plain"]), jax.tree.leaves(first[f"{wire}/weights"])
            )
        )
        for wire in WIRES
    }
    samples: dict = {n: [] for n in run}
    for _ in range(rounds):
        for n, go in run.items():
            samples[n].append(_time(go, iters, comm))
    return {n: statistics.median(v) for n, v in samples.items()}, same


def targets(med: dict) -> list:
    """``(weights - plain) / sync`` per wire against the issue's 0.02."""
    return [
        {
            "what": f"time: ({w} weights - plain) / sync",
            "value": (med[f"{w}/weights"] - med[f"{w}/plain"]) / med["sync"],
            "limit": 0.02,
        }
        for w in WIRES
    ]


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    from .world import mpi_world

    comm = mpi_world()
    import jaxsync

    hosts = 1 if comm is None else jaxsync.topology(comm).hosts
    mode = "one-process" if comm is None else ("cluster" if hosts > 1 else "shm")
    med, same = measure(comm, args.layers, args.width, args.batch, args.rounds, args.iters)
    if comm is not None and comm.Get_rank() != 0:
        return 0
    nbytes = args.layers * (args.width + 1) * args.width * 4
    size = 1 if comm is None else comm.Get_size()
    print(
        f"\nweights suite, {mode}: {size} process(es) on {hosts} host(s), "
        f"{args.layers} layers x {args.width} ({nbytes / 1e6:.1f} MB of gradients), batch "
        f"{args.batch}, even inputs (weight 1, not done)"
    )
    for n, v in med.items():
        print(f"{n:<18} {v * 1e3:>9.2f} ms")
    print(f"weighted result equal to the plain one, bitwise: {same}")
    checks = targets(med)
    for t in checks:
        ok = t["value"] <= t["limit"]
        print(f"{'PASS' if ok else 'MISS'} {t['what']}: {t['value']:.3f} (limit {t['limit']:.2f})")
    args.out.mkdir(parents=True, exist_ok=True)
    out = {"mode": mode, "bytes": nbytes, "median_s": med, "same": same}
    out["targets"] = checks
    (args.out / f"weights-{mode}.json").write_text(json.dumps(out, indent=1))
    return 0

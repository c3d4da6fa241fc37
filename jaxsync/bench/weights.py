"""Benchmark of ``weights=`` with even inputs: ``python -m jaxsync bench --suite weights``.

What ``weights=True`` costs a run whose replicas all have full batches (weight 1,
``done=False``): the same jitted update (as docs/strategies.md writes it:
``tx.update(grads, state, weight=w, done=d)``) of a gradient tree, with and
without ``weights=True``, for ``hierarchical_mean`` on a float32 wire and on a
bfloat16 one (where the weights travel in a small float32 synchronisation of
their own), beside the bare ``sync_gradients`` of the same tree. Timed in
interleaved rounds (each sample the median of ``--iters`` calls, the slowest
rank's; the figure the median over rounds).

Target (issue 43): with even inputs the cost of ``weights=`` is at most 2 % of
the sync: ``weighted / plain <= 1.02`` per wire. Run it under ``mpirun -n 2`` and
on the emulated cluster (``python -m jaxsync cluster --hosts 2 --procs-per-host 1
--link 100mbit -- python -m jaxsync bench --suite weights``); without MPI it runs
in one process (no wire: a smoke run). Writes ``weights-<mode>.json`` to
``--out``. Figures on a shared machine are noisy: read ratios from one run.

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
from .trees import resnet18_like, small_leaves

TREES = {"resnet18": resnet18_like, "small": lambda: small_leaves(8, 64)}
WIRES = {"float32": None, "bfloat16": "bfloat16"}


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m jaxsync bench --suite weights")
    p.add_argument("--tree", choices=sorted(TREES), default="resnet18")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    return p.parse_args(argv)


def measure(comm, tree_name: str, rounds: int, iters: int) -> tuple[dict, dict]:
    """Median seconds per call of each case (``<wire>/plain``, ``<wire>/weights``,
    ``bare``), and per wire whether the weighted result equals the plain one
    bitwise (weight 1 everywhere: it must)."""
    import jax
    import jax.numpy as jnp

    import jaxsync

    spec = TREES[tree_name]()
    grads = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), spec)
    fns = {}
    for wire, dtype in WIRES.items():
        for weights in (False, True):
            tx = jaxsync.hierarchical_mean(None, comm, comm_dtype=dtype, weights=weights)
            state = tx.init(grads)
            extra = {"weight": jnp.float32(1), "done": jnp.bool_(False)} if weights else {}
            f = jax.jit(lambda g, s, tx=tx, extra=extra: tx.update(g, s, **extra)[0])
            fns[f"{wire}/{'weights' if weights else 'plain'}"] = (f, state)
    bare = jax.jit(lambda g: jaxsync.sync_gradients(g, axis_name=None, comm=comm))

    def caller(f, s):
        return lambda: jax.block_until_ready(f(grads, s))

    run = {n: caller(f, s) for n, (f, s) in fns.items()}
    run["bare"] = lambda: jax.block_until_ready(bare(grads))
    for go in run.values():  # compile
        go()
    same = {}
    for w in WIRES:
        (fp, sp), (fw, sw) = fns[f"{w}/plain"], fns[f"{w}/weights"]
        a, b = jax.tree.leaves(fp(grads, sp)), jax.tree.leaves(fw(grads, sw))
        same[w] = all(bool(jnp.array_equal(x, y)) for x, y in zip(a, b))
    samples: dict = {n: [] for n in run}
    for _ in range(rounds):
        for n, go in run.items():
            samples[n].append(_time(go, iters, comm))
    return {n: statistics.median(v) for n, v in samples.items()}, same


def targets(med: dict) -> list:
    """``weighted / plain`` per wire against the issue's 1.02."""
    return [
        {
            "what": f"time: {w} weights / plain",
            "value": med[f"{w}/weights"] / med[f"{w}/plain"],
            "limit": 1.02,
        }
        for w in WIRES
    ]


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    from .world import mpi_world

    comm = mpi_world()
    import jax

    import jaxsync

    hosts = 1 if comm is None else jaxsync.topology(comm).hosts
    mode = "one-process" if comm is None else ("cluster" if hosts > 1 else "shm")
    med, same = measure(comm, args.tree, args.rounds, args.iters)
    if comm is not None and comm.Get_rank() != 0:
        return 0
    spec = TREES[args.tree]()
    nbytes = sum(int(s.size) * s.dtype.itemsize for s in jax.tree.leaves(spec))
    size = 1 if comm is None else comm.Get_size()
    print(
        f"\nweights suite, {mode}: {size} process(es) on {hosts} host(s), tree "
        f"{args.tree} ({nbytes / 1e6:.1f} MB), even inputs (weight 1, not done)"
    )
    for n, v in med.items():
        print(f"{n:<18} {v * 1e3:>9.2f} ms")
    print(f"weighted result equal to the plain one, bitwise: {same}")
    checks = targets(med)
    for t in checks:
        ok = t["value"] <= t["limit"]
        print(f"{'PASS' if ok else 'MISS'} {t['what']}: {t['value']:.3f} (limit {t['limit']:.2f})")
    args.out.mkdir(parents=True, exist_ok=True)
    out = {"mode": mode, "tree": args.tree, "bytes": nbytes, "median_s": med, "same": same}
    out["targets"] = checks
    (args.out / f"weights-{mode}.json").write_text(json.dumps(out, indent=1))
    return 0

"""Benchmark of gradient accumulation: ``python -m jaxsync bench --suite accumulate``.

``k`` micro-steps (forward, backward, the transform's update, SGD) of the
overlap suite's layer stack (``--layers`` x ``--width``, batch ``--batch``), one
device per process, each micro-step a call of one jitted function (as a
training loop makes them). Timed per ``k`` micro-steps, in interleaved rounds
(every sample the median of ``--iters`` repetitions, the slowest rank's; the
figure the median over rounds):

* ``compute``: the micro-step without synchronisation (``k`` of them: ``k c``);
* ``sync``: one ``hierarchical_mean`` of the gradients alone (``s``);
* ``multisteps``: ``optax.MultiSteps(optax.chain(mean, sgd), k)`` (it
  synchronises at every micro-step);
* ``accumulate``: ``jaxsync.accumulate(optax.chain(mean, sgd), k)`` (local
  sums, one synchronisation per ``k``).

Bytes: each case's synchronisations per ``k`` micro-steps are counted (a
callback in the mean's place) and multiplied by the gradients' bytes.
Targets (issue 46): ``accumulate`` sends ``1/k`` of ``multisteps``' bytes, and
its time is within 1.1x of ``(k c + s) / (k (c + s))`` of ``multisteps``'. Run it
under ``mpirun -n 2`` and on the emulated cluster (``python -m jaxsync cluster
--hosts 2 --procs-per-host 1 --link 100mbit -- python -m jaxsync bench --suite
accumulate``). Without MPI it runs in one process (no wire: a smoke run).
Writes ``accumulate-<mode>.json`` to ``--out``. Figures on a shared machine
are noisy: read ratios from one run.

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


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m jaxsync bench --suite accumulate")
    p.add_argument("--k", type=int, default=4, help="micro-steps per update (default 4)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    return p.parse_args(argv)


def _cases(comm, k, counter):
    import optax

    import jaxsync

    def mean():
        return counter(jaxsync.hierarchical_mean(None, comm))

    return {
        "compute": None,
        "multisteps": optax.MultiSteps(optax.chain(mean(), optax.sgd(1e-2)), k),
        "accumulate": jaxsync.accumulate(optax.chain(mean(), optax.sgd(1e-2)), k, axis_name=None),
    }


def measure(comm, k, layers, width, batch, rounds, iters):
    """Median seconds per ``k`` micro-steps per case, syncs counted per ``k``
    micro-steps, and the gradients' bytes."""
    import jax
    import jax.numpy as jnp
    import optax

    import jaxsync

    rank = 0 if comm is None else comm.Get_rank()
    params = make_params(layers, width)
    x = jax.random.normal(jax.random.PRNGKey(1 + rank), (batch, width))
    nbytes = sum(int(a.size) * 4 for a in jax.tree.leaves(params))
    calls: list = []

    def counter(inner):
        def update(u, s, p=None):
            jax.debug.callback(lambda: calls.append(1))
            return inner.update(u, s, p)

        return optax.GradientTransformation(inner.init, update)

    fns, syncs = {}, {}
    for name, tx in _cases(comm, k, counter).items():
        opt = optax.sgd(1e-2) if tx is None else tx

        def step(p, s, x, opt=opt):
            g = jax.grad(loss)(p, x)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        f = jax.jit(step, donate_argnums=(0, 1))
        carry = [jax.tree.map(jnp.copy, params)]
        carry.append(opt.init(carry[0]))

        def go(f=f, carry=carry):
            for _ in range(k):
                carry[:] = f(carry[0], carry[1], x)
            jax.block_until_ready(carry)

        go()  # compile
        calls.clear()
        go()
        jax.effects_barrier()
        syncs[name] = len(calls)
        fns[name] = go
    sync_fn = jax.jit(lambda g: jaxsync.sync_gradients(g, axis_name=None, comm=comm))
    grads = jax.grad(loss)(params, x)
    fns["sync"] = lambda: jax.block_until_ready(sync_fn(grads))
    fns["sync"]()
    samples: dict = {n: [] for n in fns}
    for _ in range(rounds):
        for n, fn in fns.items():
            samples[n].append(_time(fn, iters, comm))
    return {n: statistics.median(v) for n, v in samples.items()}, syncs, nbytes


def targets(med, syncs, k):
    """The issue's two targets, from the medians and the counted syncs."""
    c = med["compute"] / k
    s = med["sync"]
    ideal = (k * c + s) / (k * (c + s))
    ratio = med["accumulate"] / med["multisteps"]
    bytes_ratio = syncs["accumulate"] / max(syncs["multisteps"], 1)
    return [
        {"what": "bytes: accumulate / multisteps", "value": bytes_ratio, "limit": 1 / k},
        {"what": "time: accumulate / multisteps", "value": ratio, "limit": 1.1 * ideal},
    ]


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    from .world import mpi_world

    comm = mpi_world()
    import jaxsync

    hosts = 1 if comm is None else jaxsync.topology(comm).hosts
    mode = "one-process" if comm is None else ("cluster" if hosts > 1 else "shm")
    import jax

    with jax.numpy_dtype_promotion("standard"):  # optax's MultiSteps mixes int and float
        med, syncs, nbytes = measure(
            comm, args.k, args.layers, args.width, args.batch, args.rounds, args.iters
        )
    if comm is not None and comm.Get_rank() != 0:
        return 0
    checks = targets(med, syncs, args.k)
    size = 1 if comm is None else comm.Get_size()
    print(
        f"\naccumulate suite, {mode}: {size} process(es) on {hosts} host(s), k={args.k}, "
        f"{args.layers} layers x {args.width}, batch {args.batch}, {nbytes / 1e6:.1f} MB of "
        f"gradients; c = {med['compute'] / args.k * 1e3:.1f} ms per micro-step, "
        f"s = {med['sync'] * 1e3:.1f} ms per sync"
    )
    for n, v in med.items():
        extra = f"  syncs per k: {syncs[n]}" if n in syncs else ""
        print(f"{n:<12} {v * 1e3:>9.1f} ms{extra}")
    for t in checks:
        ok = t["value"] <= t["limit"] + 1e-12
        print(f"{'PASS' if ok else 'MISS'} {t['what']}: {t['value']:.3f} (limit {t['limit']:.3f})")
    args.out.mkdir(parents=True, exist_ok=True)
    out = {"mode": mode, "k": args.k, "median_s": med, "syncs": syncs, "bytes": nbytes}
    out["targets"] = checks
    (args.out / f"accumulate-{mode}.json").write_text(json.dumps(out, indent=1))
    return 0

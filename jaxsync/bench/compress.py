"""Benchmark of the compressed transforms: ``python -m jaxsync bench --suite compress``.

For the ResNet-like and transformer-like trees of ``jaxsync.bench.trees`` it reports,
per synchroniser (``hierarchical_mean``, ``powersgd_mean`` rank 4 and rank 1,
``sign_mean``, and ``hierarchical_mean`` with ``comm_dtype=jaxsync.Quantized``
int8 and int4 at block 2048; ``--syncs`` picks some):

* **bytes**: what one replica puts into collectives per step (the payload), and
  the ratio against ``hierarchical_mean``. Counted from the transforms' own
  leaf layout (the same functions that decide what is compressed).
* **marginal step cost**: ``time(step with sync) - time(same step without)``,
  the README's step (``jit(shard_map)`` over the local devices, state passed
  with ``jaxsync.state_specs``), median of interleaved rounds, every sample the
  slowest rank's. Under ``mpirun -n P`` the inter-process stage is MPI; run
  plainly it is one process (``comm=None``): then the marginal is the cost of
  compressing and decompressing alone. Beside it, the bare collectives of the
  same payloads: ``mpi4py`` ``Allreduce`` (out of place) of the uncompressed
  bytes and of PowerSGD's two payloads, ``Allgather`` of the sign payload.
* **modelled time** at 10 and 100 Gb/s between hosts for ``P`` = 2, 8 and 32
  hosts: the measured one-process compute overhead plus a ring alpha-beta model
  of every collective (:func:`ring_time`: jaxsync's cost model with the ring
  algorithm on a link of the stated bandwidth; constants below).

Figures on a shared machine are noisy: read ratios from one run.

What it may import: numpy, jax, mpi4py, ``jaxsync`` (public API), the other
``jaxsync.bench`` modules, and three private pieces of jaxsync for want of a public
API: ``jaxsync.compress._common``'s leaf layouts (``_powersgd_layout``, ``_sign_layout``:
the payload is counted by the functions that decide what is compressed) and
``jaxsync.auto._cost`` (``Link``, ``collective_seconds``: the ring model is jaxsync's
cost model).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

from jaxsync import wire_formats

# Ring alpha-beta model: a collective over P members in a ring takes
# ``steps * ALPHA + bytes_sent_per_member / bandwidth``.
ALPHA_S = 5e-6  # per message latency (a typical TCP/RoCE figure)
BANDWIDTHS_GBPS = (10.0, 100.0)
MODEL_HOSTS = (2, 8, 32)


def ring_time(kind: str, nbytes: float, members: int, gbps: float, alpha: float = ALPHA_S) -> float:
    """Seconds for one ring collective whose per-member payload is ``nbytes``.

    jaxsync's cost model (:func:`jaxsync.auto._cost.collective_seconds`, ring
    algorithm) on a link of ``gbps`` with ``alpha`` seconds per message and no
    reduction cost (this models the wire; the compute overhead is measured).
    ``allreduce``: reduce-scatter + all-gather, ``2 (P-1)`` steps of ``nbytes/P``.
    ``allgather``: ``P-1`` steps of ``nbytes`` (every member's payload reaches
    every other member).
    """
    from jaxsync.auto import _cost

    if members <= 1 or nbytes == 0:
        return 0.0
    if kind not in ("allreduce", "allgather"):
        raise ValueError(kind)
    link = _cost.Link(alpha=alpha, beta=8.0 / (gbps * 1e9), gamma=0.0)
    total = nbytes * members if kind == "allgather" else nbytes  # the model's size
    return _cost.collective_seconds(kind, total, members, link, "ring")


def payloads(name: str, tree) -> list[tuple[str, int]]:
    """``[(collective kind, bytes per replica)]`` of one step of synchroniser ``name``."""
    import jax
    import numpy as np

    from jaxsync.compress import _common as _compress

    leaves = jax.tree.leaves(tree)
    nbytes = [math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves]
    if name == "hierarchical":
        return [("allreduce", sum(nbytes))]
    if name.startswith("powersgd"):
        rank = int(name.split("r")[-1])
        layout = _compress._powersgd_layout(leaves, rank, 2.0, "auto")  # the default view
        exact = sum(b for b, lay in zip(nbytes, layout) if lay is None)
        p = sum(4 * n * r for lay in layout if lay for n, m, r in [lay])
        q = sum(4 * m * r for lay in layout if lay for n, m, r in [lay])
        return [("allreduce", p + exact), ("allreduce", q)]
    if name in QUANT:  # quantized all-to-all + all-gather: a ring allreduce's bytes
        q = QUANT[name]
        floating = [math.prod(x.shape) for x in leaves if np.dtype(x.dtype).kind == "f"]
        exact = sum(b for b, x in zip(nbytes, leaves) if np.dtype(x.dtype).kind != "f")
        return [("allreduce", q.wire_bytes(sum(floating)) + exact)]
    if name == "sign":
        layout = _compress._sign_layout(leaves, 256)
        exact = sum(b for b, c in zip(nbytes, layout) if not c)
        packed = sum(-(-math.prod(x.shape) // 8) + 4 for x, c in zip(leaves, layout) if c)
        return [("allreduce", exact), ("allgather", packed)]
    raise ValueError(name)


# hierarchical_mean with comm_dtype=jaxsync.Quantized(...) (block 2048): the
# registry's integer block formats
QUANT = {f.name: f.comm_dtype for f in wire_formats(quantized=True) if f.name.startswith("int")}
SYNCS = ("hierarchical", "powersgd r4", "powersgd r1", "sign", *QUANT)


def make_sync(name: str, comm):
    import jaxsync

    if name == "hierarchical":
        return jaxsync.hierarchical_mean(axis_name="local", comm=comm)
    if name in QUANT:
        return jaxsync.hierarchical_mean(axis_name="local", comm=comm, comm_dtype=QUANT[name])
    if name.startswith("powersgd"):
        return jaxsync.powersgd_mean(axis_name="local", comm=comm, rank=int(name.split("r")[-1]))
    return jaxsync.sign_mean(axis_name="local", comm=comm)


def _trees(quick: bool, only=None):
    from .trees import resnet18_like, transformer_like

    if quick:
        return {"transformer_tiny": lambda: transformer_like(2, 64, 256)}
    trees = {"resnet18": resnet18_like, "transformer": transformer_like}
    return {k: v for k, v in trees.items() if only is None or k in only}


class _Steps:
    """The README's step over the local devices, with and without a sync."""

    def __init__(self, comm):
        import jax
        import numpy as np
        from jax.sharding import Mesh

        self.comm = comm
        self.mesh = Mesh(np.array(jax.local_devices()), ("local",))

    def base(self, tree):
        import jax
        from jax.sharding import PartitionSpec as P

        from .methods import fake_grads

        def body(p):
            g = fake_grads(p)
            return jax.tree.map(lambda a, b: a - 1e-3 * b, p, g)

        f = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=P(), out_specs=P()))
        return lambda p, s: (f(p), s), None

    def synced(self, tree, name, params):
        import jax
        from jax.sharding import PartitionSpec as P

        import jaxsync

        from .methods import fake_grads

        tx = make_sync(name, self.comm)
        specs = jaxsync.state_specs(jax.eval_shape(tx.init, params), "local")
        state = jax.jit(jax.shard_map(tx.init, mesh=self.mesh, in_specs=P(), out_specs=specs))(
            params
        )

        def body(p, s):
            g = jax.tree.map(lambda a: jax.lax.pcast(a, "local", to="varying"), fake_grads(p))
            u, s = tx.update(g, s, p)
            return jax.tree.map(lambda a, b: a - 1e-3 * b, p, u), s

        f = jax.jit(
            jax.shard_map(body, mesh=self.mesh, in_specs=(P(), specs), out_specs=(P(), specs))
        )
        return f, state


def _bare(comm, kind, nbytes):
    """A bare mpi4py collective of ``nbytes`` (float32 buffers, preallocated)."""
    import numpy as np
    from mpi4py import MPI

    n = max(1, nbytes // 4)
    x = np.ones(n, np.float32)
    if kind == "allreduce":
        out = np.empty_like(x)
        return lambda: comm.Allreduce(x, out, op=MPI.SUM)
    out = np.empty((comm.Get_size(), n), np.float32)
    return lambda: comm.Allgather(x, out)


def _time(fn, iters, comm):
    """Median seconds per call over ``iters`` calls, the slowest rank's."""
    if comm is not None:
        comm.Barrier()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    if comm is not None:
        from mpi4py import MPI

        t = comm.allreduce(t, op=MPI.MAX)
    return t


def measure(tree_name, tree, comm, rounds, iters, syncs=SYNCS):
    """Marginal step cost of each sync (median over rounds), and bare collectives."""
    import jax
    import jax.numpy as jnp

    steps = _Steps(comm)
    params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), tree)
    cases = {"base": steps.base(tree)}
    for name in syncs:
        cases[name] = steps.synced(tree, name, params)
    carry = {k: (params, st) for k, (f, st) in cases.items()}

    def runner(key):
        f = cases[key][0]

        def go():
            p, s = carry[key]
            p, s = f(p, s)
            jax.block_until_ready(p)
            carry[key] = (p, s)

        return go

    for key in cases:  # compile and warm up
        for _ in range(2):
            runner(key)()
    samples = {k: [] for k in cases}
    bare = {}
    if comm is not None:
        for name in syncs:
            for i, (kind, nbytes) in enumerate(payloads(name, tree)):
                bare[f"{name}:{kind}{i}"] = (_bare(comm, kind, nbytes), [])
    for _ in range(rounds):
        for key in cases:
            samples[key].append(_time(runner(key), iters, comm))
        for fn, got in bare.values():
            got.append(_time(fn, iters, comm))
    base = samples["base"]
    marg = {
        k: statistics.median([a - b for a, b in zip(v, base)])
        for k, v in samples.items()
        if k != "base"
    }
    bares = {}
    for name in syncs:
        bares[name] = sum(
            statistics.median(got) for key, (_, got) in bare.items() if key.startswith(name + ":")
        )
    return marg, (bares if comm is not None else {}), statistics.median(base)


def _parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m jaxsync bench --suite compress",
        description="Bytes, marginal step cost and modelled time of powersgd_mean and "
        "sign_mean against hierarchical_mean. Run plainly (one process: "
        "compute overhead only) or under mpirun -n 2.",
    )
    p.add_argument("--quick", action="store_true", help="a tiny tree, 2 rounds (smoke test)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5)")
    p.add_argument("--iters", type=int, default=None, help="calls per sample (default 10)")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("bench-results"),
        help="directory for compress-<mode>.json (default bench-results/)",
    )
    p.add_argument(
        "--syncs",
        default=",".join(SYNCS),
        help=f"comma list of the synchronisers to run (default all: {','.join(SYNCS)}; "
        "hierarchical is the reference and always runs)",
    )
    p.add_argument("--trees", default=None, help="comma list: resnet18, transformer (default both)")
    args = p.parse_args(argv)
    args.syncs = tuple(dict.fromkeys(["hierarchical", *args.syncs.split(",")]))
    if any(s not in SYNCS for s in args.syncs):
        p.error(f"--syncs: each one of {', '.join(SYNCS)}, got {','.join(args.syncs)}")
    args.trees = None if args.trees is None else args.trees.split(",")
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.iters = args.iters or (2 if args.quick else 10)
    if args.rounds < 1 or args.iters < 1:
        p.error("--rounds and --iters must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    from .trees import tree_info
    from .world import mpi_world

    comm = mpi_world()
    import jax

    rank = 0 if comm is None else comm.Get_rank()
    procs = 1 if comm is None else comm.Get_size()
    rows = []
    for tree_name, make in _trees(args.quick, args.trees).items():
        tree = make()
        leaves, params, nbytes = tree_info(tree)
        if rank == 0:
            print(f"[{tree_name}] {leaves} leaves, {params / 1e6:.2f} M params", flush=True)
        marg, bares, base = measure(tree_name, tree, comm, args.rounds, args.iters, args.syncs)
        full = sum(b for _, b in payloads("hierarchical", tree))
        for name in args.syncs:
            pay = payloads(name, tree)
            total = sum(b for _, b in pay)
            row = {
                "tree": tree_name,
                "sync": name,
                "payload_bytes": total,
                "bytes_ratio": full / total,
                "collectives": pay,
                "marginal_ms": marg[name] * 1e3,
                "base_step_ms": base * 1e3,
                "bare_ms": bares.get(name, float("nan")) * 1e3,
                "processes": procs,
                "devices": jax.local_device_count(),
                "modelled_ms": {},
            }
            rows.append(row)
        # Modelled: one-process compute overhead (measured when run plainly;
        # under MPI the marginal minus the bare collective) + ring model.
        for row in (r for r in rows if r["tree"] == tree_name):
            over = (
                row["marginal_ms"]
                if comm is None
                else max(0.0, row["marginal_ms"] - row["bare_ms"])
            )
            row["overhead_ms"] = over
            for hosts in MODEL_HOSTS:
                for gbps in BANDWIDTHS_GBPS:
                    comm_s = sum(ring_time(k, b, hosts, gbps) for k, b in row["collectives"])
                    row["modelled_ms"][f"{hosts}x{gbps:g}"] = over + comm_s * 1e3
    if rank != 0:
        return 0
    mode = "mpi" if comm is not None else "local"
    print(
        f"\ncompress suite, {mode}: {procs} process(es) x {jax.local_device_count()} "
        f"device(s); marginal = step with sync - step without (median of "
        f"{args.rounds} rounds, slowest rank); load average {os.getloadavg()[0]:.1f}"
    )
    hdr = (
        f"{'tree':<16} {'sync':<13} {'bytes/replica':>13} {'less':>6} "
        f"{'marginal':>9} {'bare':>8} "
        + " ".join(f"{f'{h}h@{g:g}G':>9}" for h in MODEL_HOSTS for g in BANDWIDTHS_GBPS)
    )
    print(hdr)
    for r in rows:
        print(
            f"{r['tree']:<16} {r['sync']:<13} {r['payload_bytes'] / 1e6:>11.3f}MB "
            f"{r['bytes_ratio']:>5.1f}x {r['marginal_ms']:>7.2f}ms "
            f"{r['bare_ms']:>6.2f}ms "
            + " ".join(
                f"{r['modelled_ms'][f'{h}x{g:g}']:>7.2f}ms"
                for h in MODEL_HOSTS
                for g in BANDWIDTHS_GBPS
            )
        )
    print(
        f"modelled: compute overhead + ring alpha-beta (alpha {ALPHA_S * 1e6:g} us), "
        f"columns <hosts>h@<Gb/s>"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"compress-{mode}.json"
    meta = {
        "mode": mode,
        "processes": procs,
        "devices": jax.local_device_count(),
        "rounds": args.rounds,
        "iters": args.iters,
        "quick": args.quick,
        "alpha_s": ALPHA_S,
        "loadavg": os.getloadavg(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

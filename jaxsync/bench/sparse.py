"""Benchmark suite ``sparse``: a row-sparse embedding gradient, gathered or reduced.

What it may import: numpy, jax, mpi4py, ``jaxsync`` (public API) and
``jaxsync.bench.world``.

``mpirun -n 2 python -m jaxsync bench --suite sparse`` times, inside the README's
step (``jit(shard_map)`` over the local devices, ``axis_name="local"``,
``comm=MPI.COMM_WORLD``), the synchronisation of the gradient of a
``--rows`` x ``--dim`` float32 table of which each replica touched ``k`` rows:

* ``sparse``: ``hierarchical_mean(sparse=SparseOptions(mode="sparse"))``: the
  ``RowSparse`` (indices + values) all-gathered, ``R*k`` rows out;
* ``dense``: ``hierarchical_mean(sparse=SparseOptions(mode="dense"))``: the rows
  scattered into the dense table, which is all-reduced (what a user without a
  sparse path does: ``hierarchical_mean`` of the dense gradient);
* ``auto``: the default choice (sparse when ``R*k*(row_bytes+4) < rows*row_bytes``).

Each is the *marginal* cost: the step with the sync minus the same step without
it (the base step makes the fake gradient, ``values + 1``, and for ``dense``
also scatters it into the dense table, so only the synchronisation is counted).
Beside them, the bare collectives of the same bytes: mpi4py ``Allgather`` of
preallocated numpy buffers (``k*(row_bytes+4)`` bytes per rank) and in-place
``Allreduce`` of the dense table. Every sample is the slowest rank's (a
barrier, then each rank times one call, then the maximum over ranks); rounds
are interleaved and the marginal is taken per round. ``k`` is swept
(``--sweep``) to show where the crossover lies and what ``auto`` picks.

"Wire bytes" are modelled per replica: all-gather ``(P-1)·k·(row_bytes+4)``,
allreduce ``2(P-1)/P·rows·row_bytes``. Results go to ``--out``
(``sparse.json``); only rank 0 prints or writes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def _parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m jaxsync bench --suite sparse",
        description="Row-sparse vs dense synchronisation of an embedding gradient "
        "(run under mpirun -n 2).",
    )
    p.add_argument("--rows", type=int, default=1_000_000, help="table rows (default 1M)")
    p.add_argument("--dim", type=int, default=64, help="row width (default 64, float32)")
    p.add_argument("--k", type=int, default=4096, help="touched rows per replica (4096)")
    p.add_argument(
        "--sweep",
        type=int,
        nargs="*",
        default=None,
        help="values of k for the crossover sweep (default 1024 16384 131072 1048576; none: skip)",
    )
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds (5)")
    p.add_argument("--iters", type=int, default=None, help="calls per sample (5)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a small table, 2 rounds: a smoke test, not a measurement",
    )
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    a = p.parse_args(argv)
    if a.quick:
        a.rows, a.dim, a.k = min(a.rows, 4096), min(a.dim, 8), min(a.k, 64)
        a.sweep = [16, 2048] if a.sweep is None else a.sweep
    elif a.sweep is None:
        a.sweep = [1024, 16384, 131072, 1048576]
    a.repeats = a.repeats or (2 if a.quick else 5)
    a.iters = a.iters or (2 if a.quick else 5)
    if min(a.rows, a.dim, a.k, a.repeats, a.iters) < 1 or any(k < 1 for k in a.sweep):
        p.error("--rows, --dim, --k, --sweep, --repeats and --iters must be positive")
    return a


def main(argv=None) -> int:
    """``python -m jaxsync bench --suite sparse [options]``; returns the exit status."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    from .world import mpi_world, set_devices

    comm = mpi_world()
    set_devices(1)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jaxsync

    procs = 1 if comm is None else comm.Get_size()
    rank = 0 if comm is None else comm.Get_rank()
    mesh = Mesh(np.array(jax.local_devices()), ("local",))
    V, D = args.rows, args.dim
    row_bytes = D * 4

    def slowest(t):
        return t if comm is None else comm.allreduce(t, op=_max())

    def barrier():
        if comm is not None:
            comm.Barrier()

    def sample(fn):
        """Median over calls of the slowest rank's time of one call."""
        ts = []
        for _ in range(args.iters):
            barrier()
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            ts.append(slowest(time.perf_counter() - t0))
        return statistics.median(ts)

    def inputs(k):
        rng = np.random.default_rng(rank)
        idx = rng.integers(0, V, size=(1, k)).astype(np.int32)
        vals = (np.arange(k * D).reshape(1, k, D) % 5 + rank).astype(np.float32)
        return jnp.asarray(idx), jnp.asarray(vals)

    def make(mode, k):
        """(step with sync, base step) for one mode, jitted and compiled."""
        sync = (
            None
            if mode is None
            else jaxsync.hierarchical_mean(
                axis_name="local", comm=comm, sparse=jaxsync.SparseOptions(mode=mode)
            )
        )

        def local(idx, vals, dense_base):
            g = jaxsync.RowSparse(idx[0], vals[0] + 1.0, num_rows=V)
            if sync is None:
                out = g.todense() if dense_base else g
            else:
                out = sync.update({"emb": g}, sync.init({"emb": g}))[0]["emb"]
            return jax.tree.map(lambda x: x[None], out)

        def build(dense_base):
            f = jax.jit(
                jax.shard_map(
                    lambda i, v: local(i, v, dense_base),
                    mesh=mesh,
                    in_specs=(P("local"), P("local")),
                    out_specs=P("local"),
                )
            )
            return f

        return build

    rows, sweep_rows = [], []

    def measure(k, modes, with_bare):
        idx, vals = inputs(k)
        cases = {}
        for m in modes:
            cases[m] = make(m, k)(False).lower(idx, vals).compile()
        base_sparse = make(None, k)(False).lower(idx, vals).compile()
        base_dense = make(None, k)(True).lower(idx, vals).compile()
        # Correctness: the gathered rows scatter to the dense mean, bitwise.
        res = {m: jax.block_until_ready(cases[m](idx, vals)) for m in modes}
        dense_of = lambda r: (
            r
            if not isinstance(r, jaxsync.RowSparse)  # noqa: E731
            else jaxsync.RowSparse(r.indices[0], r.values[0], num_rows=V).todense()[None]
        )
        ref = np.asarray(dense_of(res[modes[0]]))
        correct = all(np.array_equal(np.asarray(dense_of(res[m])), ref) for m in modes)
        # The side each mode took (what auto picks): a RowSparse comes back gathered.
        chosen = {m: "sparse" if isinstance(res[m], jaxsync.RowSparse) else "dense" for m in modes}
        del res
        bare = {}
        if with_bare and comm is not None:
            send = np.zeros(k * (D + 1), np.float32)
            recv = np.zeros(procs * send.size, np.float32)
            table = np.zeros(V * D, np.float32)
            from mpi4py import MPI

            bare = {
                "allgather bare": lambda: comm.Allgather(send, recv),
                "allreduce bare (in place)": lambda: comm.Allreduce(
                    MPI.IN_PLACE, table, op=MPI.SUM
                ),
            }
        samples = {m: [] for m in [*modes, *bare]}
        for _ in range(args.repeats):
            bs = sample(lambda: base_sparse(idx, vals))
            bd = sample(lambda: base_dense(idx, vals))
            for m in modes:
                base = bd if chosen[m] == "dense" else bs
                samples[m].append(sample(lambda m=m: cases[m](idx, vals)) - base)
            for name, fn in bare.items():
                samples[name].append(sample(fn))
        out = {}
        for m, s in samples.items():
            side = chosen.get(m, "sparse" if "gather" in m else "dense")
            wire = (
                (procs - 1) * k * (row_bytes + 4)
                if side == "sparse"
                else 2 * (procs - 1) / procs * V * row_bytes
            )
            out[m] = {
                "k": k,
                "method": m if m in bare else f"{m}",
                "side": side,
                "median_ms": statistics.median(s) * 1e3,
                "samples_ms": [x * 1e3 for x in s],
                "wire_bytes": wire,
                "correct": None if m in bare else correct,
            }
        return out

    t0 = time.perf_counter()
    load0 = os.getloadavg()
    main_rows = measure(args.k, ["sparse", "dense", "auto"], True)
    rows = list(main_rows.values())
    for k in args.sweep:
        got = measure(k, ["sparse", "dense", "auto"], False)
        sweep_rows += list(got.values())
    if rank != 0:
        return 0
    sp, de = main_rows["sparse"]["median_ms"], main_rows["dense"]["median_ms"]
    meta = {
        "suite": "sparse",
        "processes": procs,
        "devices": 1,
        "rows": V,
        "dim": D,
        "k": args.k,
        "repeats": args.repeats,
        "iters": args.iters,
        "quick": args.quick,
        "jax": jax.__version__,
        "cpus": os.cpu_count(),
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
        "seconds": round(time.perf_counter() - t0, 1),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    ratio = de / sp if sp > 0 else float("inf")
    print(
        f"jaxsync bench --suite sparse: {procs} process(es) x 1 device, table "
        f"{V} x {D} f32 ({V * row_bytes / 2**20:.0f} MiB), slowest rank, median of "
        f"{args.repeats} rounds; load average {load0[0]:.1f} (shared machine)"
    )
    print(f"{'k':>9} {'method':<26} {'side':<7} {'ms':>9} {'wire/replica':>14} correct")
    for r in rows + sweep_rows:
        print(
            f"{r['k']:>9} {r['method']:<26} {r['side']:<7} {r['median_ms']:>9.3f} "
            f"{r['wire_bytes'] / 2**20:>11.2f} MiB {r['correct']}"
        )
    print(
        f"sparse vs dense hierarchical_mean at k={args.k}: {ratio:.1f}x faster "
        f"(target >= 20x: {'PASS' if ratio >= 20 else 'MISS'})"
    )
    for m, bare in (("sparse", "allgather bare"), ("dense", "allreduce bare (in place)")):
        if bare in main_rows and main_rows[bare]["median_ms"] > 0:
            print(f"{m} / {bare}: {main_rows[m]['median_ms'] / main_rows[bare]['median_ms']:.2f}x")
    picks = []
    for k in sorted({r["k"] for r in sweep_rows}):
        by = {r["method"]: r for r in sweep_rows if r["k"] == k}
        faster = "sparse" if by["sparse"]["median_ms"] < by["dense"]["median_ms"] else "dense"
        picks.append(
            {
                "k": k,
                "faster": faster,
                "auto_picks": by["auto"]["side"],
                "sparse_ms": by["sparse"]["median_ms"],
                "dense_ms": by["dense"]["median_ms"],
            }
        )
        print(
            f"k={k}: faster side {faster}, auto picks {by['auto']['side']} "
            f"({'right' if faster == by['auto']['side'] else 'WRONG'}; sparse "
            f"{by['sparse']['median_ms']:.2f} ms, dense {by['dense']['median_ms']:.2f} ms)"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "sparse.json"
    path.write_text(
        json.dumps(
            {
                "meta": meta,
                "rows": rows,
                "sweep": sweep_rows,
                "ratio_dense_over_sparse": ratio,
                "picks": picks,
            },
            indent=1,
        )
    )
    print(f"wrote {path}")
    return 0


def _max():
    from mpi4py import MPI

    return MPI.MAX


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

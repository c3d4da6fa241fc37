"""Marginal cost of jaxsync's syncs vs a bare MPI allreduce (not a test).

Run:  mpirun -n 2 python scripts/measure_native.py [--iters 20]

One device per process; each step is jit(shard_map) over axis "local" of size 1
and returns the synced tree. Marginal cost = median over iterations of (step
with the sync - step without, timed back to back), max over ranks. The default host allocator is
used (no tune_host_allocator). Compared with a bare mpi4py ``Allreduce`` of one
preallocated float32 buffer of the same bytes (out of place, and in place) and a
per-leaf ``mpi4jax.allreduce`` loop under plain jit.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="repeat the whole measurement (a loaded machine is noisy)",
    )
    p.add_argument("--trees", default="resnet18,small500")
    ns = p.parse_args()

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P
    from mpi4py import MPI

    import jaxsync
    from jaxsync.bench.methods import fake_grads
    from jaxsync.bench.trees import resnet18_like, small_leaves

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    peer = comm.Dup()
    mesh = Mesh(np.array(jax.devices()[:1]), ("local",))
    trees = {"resnet18": resnet18_like, "small500": lambda: small_leaves(500, 256)}

    def once(fn):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def timed(fn, iters, base=None):
        """(median, best) over iterations, max over ranks. With ``base``: the
        median of (fn - base) timed back to back, so load drifts cancel, and
        min(fn) - min(base) (the least disturbed runs, for a loaded machine)."""
        for _ in range(3):
            fn()
            if base is not None:
                base()
        ts, bs = [], []
        for _ in range(iters):
            ts.append(once(fn))
            if base is not None:
                bs.append(once(base))
        ts, bs = np.array(ts), np.array(bs)
        med = float(np.median(ts - bs)) if base is not None else float(np.median(ts))
        best = float(ts.min() - bs.min()) if base is not None else float(ts.min())
        return (comm.allreduce(med, op=MPI.MAX), comm.allreduce(best, op=MPI.MAX))

    def sharded(sync):
        def body(t):
            g = fake_grads(jax.tree.map(lambda x: x[0], t))
            if sync is not None:
                g = sync(g)
            return jax.tree.map(lambda x: x[None], g)

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("local"), out_specs=P("local")))

    def transform(factory):
        tx = factory(axis_name="local", comm=comm)
        return lambda g: tx.update(g, tx.init(g))[0]

    def mpi4jax_loop(g):
        import mpi4jax

        return jax.tree.map(
            lambda x: mpi4jax.allreduce(x, op=MPI.SUM, comm=peer) / comm.Get_size(), g
        )

    for name in ns.trees.split(",") * ns.repeats:
        spec = trees[name]()
        leaves = jax.tree.leaves(spec)
        nbytes = sum(int(np.prod(leaf.shape)) * 4 for leaf in leaves)
        x = jax.tree.map(lambda s: jnp.ones((1, *s.shape), s.dtype), spec)
        x1 = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), spec)

        def run(f, arg):
            return lambda: jax.block_until_ready(f(arg))

        base_fn = run(sharded(None), x)
        base = timed(base_fn, ns.iters)[0]
        rows = {}
        for m in ("hierarchical", "two_dimensional", "flat", "naive"):
            f = sharded(transform(getattr(jaxsync, f"{m}_mean")))
            rows[f"{m}_mean"] = timed(run(f, x), ns.iters, base_fn)
        loop = jax.jit(lambda t: mpi4jax_loop(fake_grads(t)))
        rows["mpi4jax per-leaf loop"] = timed(run(loop, x1), ns.iters, run(jax.jit(fake_grads), x1))
        send = np.ones(nbytes // 4, np.float32)
        recv = np.empty_like(send)
        bare = timed(lambda: peer.Allreduce(send, recv, op=MPI.SUM), ns.iters)
        inplace = timed(lambda: peer.Allreduce(MPI.IN_PLACE, recv, op=MPI.SUM), ns.iters)
        if rank == 0:
            print(
                f"\n{name}: {len(leaves)} leaves, {nbytes / 2**20:.1f} MiB f32, "
                f"{comm.Get_size()} processes x 1 device; step without sync "
                f"{base * 1e3:.2f} ms"
            )
            print(f"  {'':<34} {'median':>9} {'best':>9}   (ratio to bare out of place)")
            rows = {
                "bare mpi4py Allreduce out of place": bare,
                "bare mpi4py Allreduce in place": inplace,
                **rows,
            }
            for k, (med, best) in rows.items():
                print(
                    f"  {k:<34} {med * 1e3:6.3f} ms {best * 1e3:6.3f} ms   "
                    f"({med / bare[0]:.2f}x, best {best / bare[1]:.2f}x)"
                )


if __name__ == "__main__":
    main()

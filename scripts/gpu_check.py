"""Part 2 of scripts/gpu_check.sh (under mpirun -n 2, on GPUs): every strategy's
mean bitwise against its closed form, and its time against mpi4jax's bare
allreduce of the same bytes.

Replica r (rank r, one GPU each) holds leaf k as r + k (integers: every sum and
the mean, (n - 1)/2 + k, are exact), in float32, bfloat16 and float16. Timings:
the median of 10 steps after a warm-up, one float32 leaf of 4 and 64 MiB.
Exits 1 when any mean is wrong.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import jaxsync

STRATEGIES = ("naive", "flat", "hierarchical", "two_dimensional")


def _median(f, x, iters=10):
    jax.block_until_ready(f(x))
    times = []
    for _ in range(iters):
        MPI.COMM_WORLD.Barrier()
        t = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main() -> int:
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"gpu_check: {n} processes, {jax.devices()[0].device_kind}, jaxsync {jaxsync.__version__}")
    dtypes = (jnp.float32, jnp.bfloat16, jnp.float16)
    tree = {f"k{k}": jnp.full((1000 + k,), rank + k, dtypes[k % 3]) for k in range(6)}
    bad = 0
    for s in STRATEGIES:
        for opts in ({}, {"overlap": True}):
            tx = getattr(jaxsync, f"{s}_mean")(axis_name=None, comm=comm, **opts)
            out = jax.jit(lambda g, tx=tx: tx.update(g, tx.init(g))[0])(tree)
            wrong = [
                k
                for k, v in out.items()
                if not np.array_equal(
                    np.asarray(v).view(np.uint8),
                    np.full(v.shape, (n - 1) / 2 + int(k[1:]), v.dtype).view(np.uint8),
                )
            ]
            ok = comm.allreduce(not wrong, op=MPI.LAND)
            bad += not ok
            say(f"{s:16s} {str(opts):18s} {'PASS' if ok else 'FAIL ' + str(wrong)}")
    import mpi4jax

    for mib in (4, 64):
        x = jnp.ones(mib * 2**18, jnp.float32)
        bare = _median(jax.jit(lambda v: mpi4jax.allreduce(v, op=MPI.SUM, comm=comm)[0]), x)
        say(f"{mib} MiB float32: mpi4jax allreduce {bare * 1e3:.2f} ms")
        for s in STRATEGIES:
            tx = getattr(jaxsync, f"{s}_mean")(axis_name=None, comm=comm)
            t = _median(jax.jit(lambda g, tx=tx: tx.update(g, tx.init(g))[0]), {"x": x})
            say(f"  {s:16s} {t * 1e3:8.2f} ms  {t / bare:5.2f}x the bare allreduce")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

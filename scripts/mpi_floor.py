"""MPI's own floor for the inter-process stage, without JAX in the timed calls.

Run: ``mpirun -n 2 python scripts/mpi_floor.py`` (from the checkout, with the
project's venv). Prints, for the benchmark's ResNet-like and transformer-like
trees (float32, the slowest rank's median of 21 calls, best of 3 rounds):

* one allreduce of all the tree's bytes, out of place and in place;
* in place, the messages ``hierarchical_mean`` sends with one device per process
  (each leaf of 64 KiB or more where it is, the smaller leaves as one message);
* in place, the same bytes in pieces of 64 KiB, 1 MiB and 4 MiB (MPI's cost per
  byte by message size);
* whether this MPI sums a derived datatype spanning the leaves (joining them
  into one message without a copy).

These are the README's "Where the remaining gaps come from" figures.
"""

from __future__ import annotations

import math
import time

import jax
import numpy as np
from mpi4py import MPI

from jaxsync.bench.trees import resnet18_like, transformer_like

comm = MPI.COMM_WORLD
SMALL = 64 * 1024


def timed(fn, reps: int = 21) -> float:
    best = math.inf
    for _ in range(3):
        ts = []
        for _ in range(reps):
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        best = min(best, comm.allreduce(float(np.median(ts)), op=MPI.MAX))
    return best * 1e3


def main() -> None:
    for name, make in (("resnet18", resnet18_like), ("transformer", transformer_like)):
        sizes = [math.prod(s.shape) for s in jax.tree.leaves(make())]
        total = sum(sizes)
        one, out = np.ones(total, np.float32), np.empty(total, np.float32)
        big = [np.ones(n, np.float32) for n in sizes if n * 4 >= SMALL]
        rest = sum(n for n in sizes if n * 4 < SMALL)
        msgs = big + ([np.ones(rest, np.float32)] if rest else [])

        def pieces(k):
            return lambda: [
                comm.Allreduce(MPI.IN_PLACE, one[a : a + k]) for a in range(0, total, k)
            ]

        rows = {
            "one message, out of place": timed(lambda: comm.Allreduce(one, out)),
            "one message, in place": timed(lambda: comm.Allreduce(MPI.IN_PLACE, one)),
            f"hierarchical's {len(msgs)} messages, in place": timed(
                lambda: MPI.Request.Waitall([comm.Iallreduce(MPI.IN_PLACE, m) for m in msgs])
            ),
        }
        for kib in (64, 1024, 4096):
            rows[f"{kib} KiB pieces, in place"] = timed(pieces(kib * 256))
        if comm.rank == 0:
            base = rows["one message, in place"]
            print(f"{name}: {len(sizes)} leaves, {total * 4 / 1e6:.1f} MB")
            for k, v in rows.items():
                print(f"  {k:<40} {v:7.2f} ms  {v / base:5.2f}x in place")
    leaves = [np.ones(n, np.float32) for n in (1000, 2000)]
    dt = MPI.FLOAT.Create_hindexed([x.size for x in leaves], [MPI.Get_address(x) for x in leaves])
    dt.Commit()
    try:
        comm.Allreduce(MPI.IN_PLACE, [MPI.BOTTOM, 1, dt])
        said = "yes"
    except MPI.Exception as e:
        said = f"no ({e.Get_error_string().splitlines()[-1].strip()})"
    dt.Free()
    if comm.rank == 0:
        print(f"MPI_SUM over a derived datatype spanning two leaves: {said}")


if __name__ == "__main__":
    main()

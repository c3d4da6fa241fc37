"""Moves ``--mbytes`` MB from rank 0 (host 0) to the last rank (the last host) and back.

Prints one JSON line from rank 0: the seconds of the one-way send (after a warm-up
message) and of a send between the two ranks of host 0 when it has two.
"""

import argparse
import json
import time

import numpy as np
from mpi4py import MPI

p = argparse.ArgumentParser()
p.add_argument("--mbytes", type=float, default=4.0)
ns = p.parse_args()
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
buf = np.ones(int(ns.mbytes * 1e6) // 4, np.float32)
small = np.ones(16, np.float32)


def one_way(src, dst):
    if rank == src:
        comm.Send(small, dst)  # warm-up: connection set up outside the timing
    elif rank == dst:
        comm.Recv(small, src)
    comm.Barrier()
    t = time.perf_counter()
    if rank == src:
        comm.Send(buf, dst)
        comm.Recv(small, dst)
    elif rank == dst:
        comm.Recv(buf, src)
        comm.Send(small, src)
    return time.perf_counter() - t


across = one_way(0, size - 1)
within = one_way(0, 1) if size > 2 else None
if rank == 0:
    print(json.dumps(dict(bytes=buf.nbytes, across=across, within=within)), flush=True)

"""A tiny training job for ``python -m jaxsync elastic`` (numpy and mpi4py; no jit).

    python -m jaxsync elastic --min-np 1 --max-np 2 -- python worker_elastic_train.py DIR

Each step every rank computes its gradient ``(rank + 1) * c(t)`` (dyadic), the ranks
average it (so the step depends on the world size), ``w -= w_lr * mean``; rank 0
checkpoints after every step (written whole, then renamed) and a barrier follows, so
a step that started had its predecessor's checkpoint on disk. On the first run
(``world().restart == 0``) rank 1 kills itself (SIGKILL) when it reaches step
``KILL_AT``: by the program's progress, not the clock. Rank 0 appends each run's
(restart, np, first step) to DIR/runs.jsonl and writes DIR/final.npy at the end. The
step and the checkpoint: ``elastic_job.py``.
"""

import json
import os
import signal
import sys

import numpy as np
from elastic_job import KILL_AT, resume, steps
from mpi4py import MPI

import jaxsync.elastic as el

folder = sys.argv[1]
ckpt = os.path.join(folder, "ckpt.npz")
me = el.world()
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
assert me.np == size, (me, size)
w, start = resume(ckpt)  # the checkpoint is the anchor
if rank == 0:
    with open(os.path.join(folder, "runs.jsonl"), "a") as f:
        f.write(json.dumps({"restart": me.restart, "np": size, "start": start}) + "\n")


def fault(t):
    if me.restart == 0 and rank == 1 and t == KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)


w = steps(comm, w, start, ckpt, writes=rank == 0, fault=fault)
if rank == 0:
    np.save(os.path.join(folder, "final.npy"), w)

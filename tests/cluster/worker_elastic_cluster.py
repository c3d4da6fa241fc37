"""A training job for ``python -m jaxsync elastic`` in the emulated cluster (numpy, mpi4py).

    python worker_elastic_cluster.py train DIR      # the job (one copy per rank)
    python worker_elastic_cluster.py discover DIR   # the host discovery script

Each step every rank computes its gradient ``(rank + 1) * c(t)`` (dyadic), the ranks
average it (so the step depends on the world size), ``w -= LR * mean``. Checkpoints
are per host, as on real machines: local rank 0 of each host writes
``DIR/hostH/ckpt.npz`` (whole, then renamed) after every step, a barrier follows,
and a restarted rank reads only its own host's folder. On the first run the
processes of host ``LOST`` mark ``lose-host`` when they reach step ``KILL_AT`` and
wait there (the others wait in that step's allreduce); the cluster's fault
``--lose-host LOST@lose-host`` then kills every process of that host: by the
program's progress, not the clock. Rank 0 appends each run's (restart, np, the
step each host's folder gave) to ``DIR/runs.jsonl``, and writes ``DIR/final.npy``.

``discover`` prints the cluster's hostfile (the hosts alive) and deletes the folder
of every host that is not in it: a lost host takes its files with it, before the
supervisor's next launch can read them.

The step and the checkpoint are ``tests/mpi/elastic_job.py``'s (``worker_elastic_train.py``'s job).
"""

import json
import os
import shutil
import sys
import time

import numpy as np

LOST = 2


def discover(folder):
    with open(os.environ["JAXSYNC_CLUSTER_HOSTFILE"]) as f:
        text = f.read()
    alive = {line.split(":")[0] for line in text.split()}
    for name in os.listdir(folder):
        if name.startswith("host") and name not in alive:
            shutil.rmtree(os.path.join(folder, name))
    sys.stdout.write(text)


def train(folder):
    from elastic_job import KILL_AT, resume, steps  # tests/mpi
    from mpi4py import MPI

    import jaxsync.cluster
    import jaxsync.elastic as el

    me = el.world()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    assert me.np == size, (me, size)
    host = int(os.environ["JAXSYNC_CLUSTER_HOST"])
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    mine = os.path.join(folder, f"host{host}")
    ckpt = os.path.join(mine, "ckpt.npz")
    w, start = resume(ckpt)  # this host's own checkpoint
    starts = comm.gather((host, start), root=0)
    if rank == 0:
        with open(os.path.join(folder, "runs.jsonl"), "a") as f:
            run = {"restart": me.restart, "np": size, "starts": sorted(set(starts))}
            f.write(json.dumps(run) + "\n")
    os.makedirs(mine, exist_ok=True)

    def fault(t):
        if me.restart == 0 and host == LOST and t == KILL_AT:
            jaxsync.cluster.mark("lose-host")
            time.sleep(600)  # killed here by the cluster, with every process of the host

    w = steps(comm, w, start, ckpt, writes=local == 0, fault=fault)
    if rank == 0:
        np.save(os.path.join(folder, "final.npy"), w)


if __name__ == "__main__":
    {"train": train, "discover": discover}[sys.argv[1]](sys.argv[2])

"""The toy job of the elastic tests (numpy and mpi4py; no jit): gradient, step, checkpoint.

Run by ``worker_elastic_train.py`` (here) and ``tests/cluster/worker_elastic_cluster.py``
under ``python -m jaxsync elastic``. Each step every rank computes its gradient
``(rank + 1) * c(t)`` (dyadic: every mean is exact), the ranks average it (so the step
depends on the world size) and ``w -= LR * mean``. A checkpoint holds ``w`` and the
next step, written whole, then renamed; :func:`steps` runs the job from a step on.
The tests compute the closed form themselves.
"""

import os

import numpy as np

STEPS, KILL_AT, LR = 8, 5, 0.5


def c(t):
    return np.array([t + 1, 0.5, -(t % 3), 0.25], dtype=np.float64)


def resume(ckpt):
    """``(w, first step)``: the checkpoint's, or zeros and 0 where there is none yet."""
    if not os.path.exists(ckpt):
        return np.zeros(4), 0
    with np.load(ckpt) as z:
        return z["w"].copy(), int(z["step"])


def step(comm, w, t):
    """``w`` after step ``t``, its gradient averaged over ``comm``."""
    from mpi4py import MPI

    g = np.empty(4)
    comm.Allreduce((comm.Get_rank() + 1) * c(t), g, op=MPI.SUM)
    return w - LR * (g / comm.Get_size())


def steps(comm, w, start, ckpt, writes, fault):
    """``w`` after steps ``start`` to ``STEPS - 1``. Each calls ``fault(t)`` first (where
    a test loses a rank), steps, checkpoints (where ``writes``: one writer a checkpoint)
    and waits at a barrier: a step that started had its predecessor's checkpoint on disk."""
    for t in range(start, STEPS):
        fault(t)
        w = step(comm, w, t)
        if writes:
            save(ckpt, w, t)
        comm.Barrier()
    return w


def save(ckpt, w, t):
    """Checkpoint ``w`` after step ``t`` (written whole, then renamed)."""
    with open(ckpt + ".tmp", "wb") as f:
        np.savez(f, w=w, step=t + 1)
    os.replace(ckpt + ".tmp", ckpt)

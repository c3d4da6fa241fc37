"""Timing rounds for ``tune``: each program's marginal seconds against a base, the
slowest process's (``_tune`` and ``_tune_sync`` both time this way).

Imports: numpy and the standard library at the top; JAX, mpi4py and ``_topology``
inside functions.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np


def _log(rank, msg):
    if rank == 0:
        print(f"[tune] {msg}", file=sys.stderr, flush=True)


def _time_rounds(fns: dict, base_key, rounds: int, iters: int, comm=None) -> dict:
    """Marginal seconds of each fn against ``fns[base_key]``: median over rounds
    of (median of ``iters`` calls); the slowest process's per round."""
    import jax

    keys = list(fns)
    samples = np.zeros((rounds, len(keys)))
    for k in keys:  # warm up
        jax.block_until_ready(fns[k]())
    for r in range(rounds):
        order = keys[r % len(keys) :] + keys[: r % len(keys)]
        for k in order:
            if comm is not None:
                comm.Barrier()
            ts = []
            for _ in range(iters):
                t0 = time.perf_counter()
                jax.block_until_ready(fns[k]())
                ts.append(time.perf_counter() - t0)
            samples[r, keys.index(k)] = statistics.median(ts)
    if comm is not None:
        from mpi4py import MPI

        comm.Allreduce(MPI.IN_PLACE, samples, op=MPI.MAX)
    b = keys.index(base_key)
    return {
        k: float(np.median(samples[:, i] - samples[:, b]))
        for i, k in enumerate(keys)
        if k != base_key
    }


def _control(comm):
    if comm is None:
        return None
    from jaxsync._comm._topology import Comms

    return Comms.of(comm).control

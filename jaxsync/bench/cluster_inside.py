"""What ``bench --suite cluster`` runs inside the emulated cluster: the link's
rate probe (``python -m jaxsync.bench.cluster probe``, mpi4py only) and the
timeline of a few synchronisations (``... cluster trace DIR TREE``, jax and jaxsync).

Example:
  >>> from jaxsync.bench import cluster_inside
  >>> cluster_inside.PROBE_BYTES * 8 / 100e6  # seconds for one way at 100 Mb/s
  1.28
"""

from __future__ import annotations

import json
import time

PROBE_BYTES = 16_000_000
TRACE_STEPS = 3  # synchronisations in the timeline, after the first configuration's runs


def probe() -> int:
    """Inside the cluster: the link rate between host 0 and the last host; rank 0
    prints JSON, the median of ``probe_rates``."""
    import numpy as np
    from mpi4py import MPI

    rates = probe_rates(MPI.COMM_WORLD, np.ones(PROBE_BYTES // 4, np.float32), rounds=3)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(json.dumps({"rate_bps": sorted(rates)[len(rates) // 2]}), flush=True)
    return 0


def probe_rates(comm, buf, rounds: int) -> list[float]:
    """``buf`` from rank 0 to the last rank, then back, one way at a time (a
    ``Sendrecv`` both ways at once sometimes ran its two directions one after the
    other: exactly half the rate, at 2 hosts x 4 processes in most exchanges),
    ``rounds`` times each way after one round that sets up the connections; the
    slowest rank's time. Every rank returns the rates in bits/s."""
    import numpy as np
    from mpi4py import MPI

    rank, last = comm.Get_rank(), comm.Get_size() - 1
    rates = []
    for i in range(2 * (rounds + 1)):
        src, dst = (0, last) if i % 2 == 0 else (last, 0)
        _poll(comm.Ibarrier())
        t = time.perf_counter()
        if rank == src:
            comm.Send(buf, dst, 0)
        elif rank == dst:
            comm.Recv(buf, src, 0)
        dt = np.array([time.perf_counter() - t])
        _poll(comm.Iallreduce(MPI.IN_PLACE, dt, op=MPI.MAX))
        if i >= 2:
            rates.append(buf.nbytes * 8 / float(dt[0]))
    return rates


def _poll(req) -> None:
    """Wait for ``req``, sleeping between tests: the waiting ranks leave the cores."""
    while not req.Test():
        time.sleep(0.001)


def trace(directory: str, tree_name: str) -> int:
    """Inside the cluster: ``TRACE_STEPS`` synchronisations of ``tree_name`` with
    ``hierarchical_mean`` (its defaults) inside ``jaxsync.timeline(directory)``."""
    import jax
    import jax.numpy as jnp

    import jaxsync

    from .trees import make_trees

    trees = {**make_trees(False), **make_trees(True)}
    grads = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), trees[tree_name]())
    tx = jaxsync.hierarchical_mean(None)
    state = tx.init(grads)
    sync = jax.jit(lambda g: tx.update(g, state)[0])
    jax.block_until_ready(sync(grads))  # compiled before the timeline starts
    with jaxsync.timeline(directory) as tl:
        for i in range(TRACE_STEPS):
            with tl.step(f"{tree_name} hierarchical {i}"):
                jax.block_until_ready(sync(grads))
    return 0

"""Blocking MPI calls across hosts poll while they wait (they do not spin).

Two processes, each faked as a host of its own (``JAXSYNC_TESTING_HOSTS``), one
device each. For each step (``sharded``: a native reduce-scatter and all-gathers;
``hierarchical_mean(overlap=False)``: a blocking allreduce in pieces;
``replica_mean``), after a warm-up call, rank 1 enters the step late (once rank
0 says it is inside, plus a pause) and rank 0 records the CPU time its process
spent over its call against the call's wall time: a call that spins takes a
core for the whole wait, one that polls almost none. Recorded too: the
``poll_us`` of every jaxsync call of each lowered step, on two hosts and on one,
and the results (equal to the chain's, bit for bit). Over rank 0's late call, the
native library's count of its polled waits' yields (between tests in the wait's
first millisecond) and sleeps (after it).

With ``--agree run`` (the default) every run of a step first exchanges its
agreement header, so the late peer's wait is spent there (in the header's own
polled loop, which these counts leave out); ``--agree once`` checks it on the
first (warm-up) run only, so the late call's wait is the data calls'.
"""

import os
import re
import time

from _worker import Results, init

PAUSE_S = 1.5


def main():
    ns, jax, MPI = init([(("--hosts",), dict(default="2")), (("--agree",), dict(default="run"))])
    os.environ["JAXSYNC_TESTING_HOSTS"] = ns.hosts  # before jaxsync reads the topology
    os.environ["JAXSYNC_AGREE"] = ns.agree  # before the native library reads it
    import jax.numpy as jnp
    import optax

    import jaxsync
    from jaxsync._comm._mpi_load import _native

    lib = _native()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    res = Results(ns.out, rank)
    params = {"w": jnp.arange(300_000.0) % 7, "b": jnp.ones((37,))}
    grads = jax.tree.map(lambda p: p * (rank + 1), params)

    def make(tx):
        return jax.jit(lambda g, s, p: tx.update(g, s, p)[0])

    cases = {
        "sharded": jaxsync.sharded(optax.sgd(1.0), axis_name=None, reduce="sum"),
        "blocking": optax.chain(
            jaxsync.hierarchical_mean(axis_name=None, reduce="sum", overlap=False), optax.sgd(1.0)
        ),
    }
    for name, tx in cases.items():
        state = tx.init(params)
        fn = make(tx)
        text = fn.lower(grads, state, params).as_text()
        res.add(f"{name}:poll", sorted(set(re.findall(r"poll_us = (\d+)", text))))
        res.add(f"{name}:result", jax.device_get(fn(grads, state, params)))  # warm-up
        comm.Barrier()
        if rank == 1:
            comm.recv(source=0, tag=7)  # rank 0 is about to enter the step
            time.sleep(PAUSE_S)
            jax.block_until_ready(fn(grads, state, params))
        else:
            polls0 = lib.jaxsync_poll_yields(), lib.jaxsync_poll_sleeps()
            cpu0, t0 = time.process_time(), time.perf_counter()
            comm.send(None, dest=1, tag=7)
            jax.block_until_ready(fn(grads, state, params))
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
            res.add(f"{name}:cpu_over_wall", cpu / wall)
            polls = lib.jaxsync_poll_yields(), lib.jaxsync_poll_sleeps()
            res.add(f"{name}:yields_sleeps", [b - a for a, b in zip(polls0, polls)])
        comm.Barrier()
    res.write()


if __name__ == "__main__":
    main()

"""Uneven inputs across processes: ``weights=`` and the join (``test_join_mpi.py``).

Replica ``q`` (numbered across processes, rank 0's devices first) has
``BATCHES[q]`` batches: its gradient at step ``t`` is ``(t + 1)(q + 1) / 4`` in
every element, its weight ``q + 1``. Every process calls the same jitted step
(``shard_map`` over its devices) until :func:`jaxsync.all_done` says every
replica is done: a replica out of data passes weight 0 and ``done=True``. Each
case records the parameters and the step count; the test compares them bitwise
with the closed-form SGD run. Then the stall case: ``timeout=1`` and rank 1
stops without joining for 3 s before its last step; rank 0's watchdog reports it.
"""

import time

from _worker import local_mesh, start, to_numpy

BATCHES = [3, 1, 2, 1, 2, 3, 1, 2]  # per replica q; rank 1 of 2x2 runs out first
LR = 0.5


def main():
    _, jax, comm, rank, size, D, res = start()
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import PartitionSpec as P

    import jaxsync

    res.add("meta", {"size": size, "devices": D})
    mesh = local_mesh("d")
    q = rank * D + np.arange(D)  # this process's replicas
    batches = np.array(BATCHES[: size * D])[q]
    params0 = {
        "a": jnp.zeros((3,), jnp.float32),
        "b": jnp.zeros((40,), jnp.float32),
        "s": jnp.zeros((), jnp.float32),
    }

    def loop(tx, stall=0.0):
        specs = jaxsync.state_specs(jax.eval_shape(tx.init, params0), "d")

        def step(p, state, g, w, done):
            g = jax.tree.map(lambda x, y: x.reshape(y.shape), g, p)
            u, state = tx.update(g, state, p, weight=w[0], done=done[0])
            return optax.apply_updates(p, u), state, jaxsync.all_done(state)

        init_ = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
        run = jax.jit(
            jax.shard_map(
                step,
                mesh=mesh,
                in_specs=(P(), specs, P("d"), P("d"), P("d")),
                out_specs=(P(), specs, P()),
            )
        )
        state, p, t = init_(params0), params0, 0
        while True:
            have = t < batches
            val = np.where(have, (t + 1) * (q + 1) / 4, 0).astype(np.float32)
            g = {k: np.repeat(val[:, None], max(v.size, 1), 1) for k, v in params0.items()}
            w = np.where(have, q + 1, 0).astype(np.float32)
            if stall and rank == 1 and t == batches.max():  # stops without joining, a while
                time.sleep(stall)
            p, state, stop = run(p, state, g, w, t + 1 >= batches)
            t += 1
            if bool(stop):
                return to_numpy(p), t

    cases = {
        "chain": lambda: optax.chain(
            jaxsync.hierarchical_mean("d", comm, weights=True), optax.sgd(LR)
        ),
        "world": lambda: optax.chain(
            jaxsync.two_dimensional_mean("d", comm, weights="world"), optax.sgd(LR)
        ),
        "overlap": lambda: optax.chain(
            jaxsync.flat_mean("d", comm, weights=True, overlap=True, overlap_bucket_bytes=64),
            optax.sgd(LR),
        ),
        "double_buffering": lambda: optax.chain(
            jaxsync.flat_mean("d", comm, weights=True, double_buffering=True), optax.sgd(LR)
        ),
        "sharded": lambda: jaxsync.sharded(optax.sgd(LR), axis_name="d", comm=comm, weights=True),
    }
    for name, make in cases.items():
        try:
            res.add(name, loop(make()))
        except Exception as e:  # noqa: BLE001
            res.add(name, f"{type(e).__name__}: {e}")
    tx = optax.chain(jaxsync.hierarchical_mean("d", comm, weights=True, timeout=1.0), optax.sgd(LR))
    res.add("stall", loop(tx, stall=3.0))
    from jaxsync._comm._topology import Comms

    res.add("reports", [r for w in Comms.of(comm)._watchdogs.values() for r in w.reports])
    res.write()


if __name__ == "__main__":
    main()

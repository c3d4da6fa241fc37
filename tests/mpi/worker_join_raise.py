"""``early_termination="raise"`` across processes (``test_join_mpi.py``).

One device a process: rank 1 has 1 batch, rank 0 has 3. Both call the same
jitted step of ``flat_mean(weights=True, early_termination="raise")``; step 0
(rank 1 passes ``done=True``) raises on both ranks, which record the error and
the step it came at.
"""

from _worker import Results, init


def main():
    ns, jax, MPI = init()
    import jax.numpy as jnp
    import optax

    import jaxsync

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    res = Results(ns.out, rank)
    batches = 3 if rank == 0 else 1
    tx = optax.chain(
        jaxsync.flat_mean(None, comm=comm, weights=True, early_termination="raise"),
        optax.sgd(0.5),
    )
    params = {"w": jnp.zeros(4, jnp.float32)}
    state = tx.init(params)

    @jax.jit
    def step(p, s, g, done):
        u, s = tx.update(g, s, p, weight=1.0, done=done)
        return optax.apply_updates(p, u), s

    got = ("OK", None)
    for t in range(batches):
        try:
            params, state = jax.block_until_ready(
                step(params, state, {"w": jnp.ones(4)}, jnp.bool_(t + 1 >= batches))
            )
        except Exception as e:  # noqa: BLE001 - recorded for the test
            got = (str(e), t)
            break
    res.add("raise", got)
    res.write()


if __name__ == "__main__":
    main()

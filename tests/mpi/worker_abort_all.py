"""Every rank raises the same clear error uncaught (jaxsync/_comm/_abort.py).

The ranks' gradient trees differ (rank 1 has one more leaf): the agreement of
the first execution raises the same ``ValueError`` on both, and neither
catches it. Whichever rank's hook calls ``MPI_Abort`` first ends the job; the
explanation must still reach the launcher's output in full.
"""

from _worker import init


def main():
    ns, jax, MPI = init()
    import jax.numpy as jnp

    import jaxsync

    rank = MPI.COMM_WORLD.Get_rank()
    tx = jaxsync.flat_mean(axis_name=None, comm=MPI.COMM_WORLD)
    tree = {"w": jnp.ones(3)} if rank == 0 else {"w": jnp.ones(3), "b": jnp.ones(2)}
    step = jax.jit(lambda g: tx.update(g, tx.init(g))[0])
    jax.block_until_ready(step(tree))
    print(f"rank {rank} finished the step (it should not)", flush=True)


if __name__ == "__main__":
    main()

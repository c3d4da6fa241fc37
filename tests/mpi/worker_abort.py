"""An uncaught exception on one rank ends the job (jaxsync/_comm/_abort.py).

Rank 0 raises while tracing (``sharded`` refuses its int32 gradient leaf) and
does not catch it; rank 1 enters the synchronisation of its float32 leaf with
no stall timeout, and would wait for rank 0 for ever. The hook jaxsync installs
prints rank 0's error and calls ``MPI_Abort``: the whole job ends non-zero.
"""

from _worker import init


def main():
    ns, jax, MPI = init()
    import jax.numpy as jnp
    import optax

    import jaxsync

    rank = MPI.COMM_WORLD.Get_rank()
    tx = jaxsync.sharded(optax.sgd(1.0), axis_name=None, comm=MPI.COMM_WORLD)
    tree = {"w": jnp.ones(3, jnp.int32 if rank == 0 else jnp.float32)}
    step = jax.jit(lambda g: tx.update(g, tx.init(g), g)[0])
    print(f"rank {rank} steps", flush=True)
    jax.block_until_ready(step(tree))
    print(f"rank {rank} finished the step (it should not)", flush=True)


if __name__ == "__main__":
    main()

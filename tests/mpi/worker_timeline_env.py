"""JAXSYNC_TIMELINE=DIR (set by the test): five steps of hierarchical_mean, the
third and fourth inside a ``with jaxsync.timeline(--out/inner)`` block (which
must take nothing from the whole run's trace); the files are written at exit."""

from _worker import Results, init


def main():
    ns, jax, MPI = init()
    import jax.numpy as jnp

    import jaxsync

    comm = MPI.COMM_WORLD
    tx = jaxsync.hierarchical_mean(axis_name=None, comm=comm)
    step = jax.jit(lambda g: tx.update(g, tx.init(g))[0])
    for _ in range(2):
        jax.block_until_ready(step({"w": jnp.ones(64)}))
    with jaxsync.timeline(f"{ns.out}/inner") as tl:
        for _ in range(2):
            jax.block_until_ready(step({"w": jnp.ones(64)}))
    jax.block_until_ready(step({"w": jnp.ones(64)}))
    res = Results(ns.out, comm.Get_rank())
    res.add("inner", str(tl.path))
    res.add("done", True)
    res.write()


if __name__ == "__main__":
    main()

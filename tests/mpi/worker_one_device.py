"""One device per process, ``axis_name=None``, plain jit (no mapped axis).

Replica ``r = rank`` holds leaf ``k`` filled with ``r + k``: the mean over
``N = size`` processes is ``(N - 1) / 2 + k`` exactly.
"""

from _worker import Results, init, to_numpy


def main():
    ns, jax, MPI = init()
    import jax.numpy as jnp
    import numpy as np
    from mpi_data import make_tree

    import jaxsync

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    res = Results(ns.out, rank)
    res.add("devices", jax.local_device_count())
    tree = jax.tree_util.tree_map(lambda x: x[0], make_tree(jnp, np, first_replica=rank, count=1))
    factories = dict(
        naive=jaxsync.naive_mean,
        flat=jaxsync.flat_mean,
        hierarchical=jaxsync.hierarchical_mean,
        two_dimensional=jaxsync.two_dimensional_mean,
    )
    for name, fac in factories.items():
        for reduce in ("mean", "sum"):
            tx = fac(axis_name=None, comm=comm, reduce=reduce)
            f = jax.jit(lambda t, tx=tx: tx.update(t, tx.init(t))[0])
            res.add(f"{name}-{reduce}", to_numpy(jax.block_until_ready(f(tree))))
    res.write()


if __name__ == "__main__":
    main()

"""One device per process, ``axis_name=None``, plain jit (no mapped axis).

Replica ``r = rank`` holds leaf ``k`` filled with ``r + k``: the mean over
``N = size`` processes is ``(N - 1) / 2 + k`` exactly.
"""

from _worker import inter_factories, start, to_numpy


def main():
    _, jax, comm, rank, _, D, res = start()
    import jax.numpy as jnp
    import numpy as np
    from mpi_data import make_tree

    res.add("devices", D)
    tree = jax.tree_util.tree_map(lambda x: x[0], make_tree(jnp, np, first_replica=rank, count=1))
    factories = inter_factories()
    for name, fac in factories.items():
        for reduce in ("mean", "sum"):
            tx = fac(axis_name=None, comm=comm, reduce=reduce)
            f = jax.jit(lambda t, tx=tx: tx.update(t, tx.init(t))[0])
            res.add(f"{name}-{reduce}", to_numpy(jax.block_until_ready(f(tree))))
    res.write()


if __name__ == "__main__":
    main()

"""Host staging keeps the order of its callbacks: many same-size leaves.

200 leaves of one size; rank r holds ``1000 r + i`` in leaf i, so a leaf matched
with the wrong leaf of the other rank gives a wrong (but finite) mean. Plain jit,
one device per process, ``staging="host"``, 10 steps per strategy.
"""

from _worker import Results, init


def main():
    ns, jax, MPI = init()
    import jax.numpy as jnp
    import numpy as np

    import jaxsync

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    res = Results(ns.out, rank)
    tree = {f"p{i:03d}": jnp.full((512,), rank * 1000.0 + i) for i in range(200)}
    tree["h"] = jnp.full((33,), rank + 1.0, jnp.bfloat16)
    for strategy in ("naive", "flat", "hierarchical"):
        tx = getattr(jaxsync, f"{strategy}_mean")(axis_name=None, comm=comm, staging="host")
        f = jax.jit(lambda g, tx=tx: tx.update(g, tx.init(g))[0])
        wrong = 0
        for _ in range(10):
            out = jax.block_until_ready(f(tree))
            wrong += sum(
                int(not np.all(np.asarray(out[f"p{i:03d}"]) == 500.0 + i)) for i in range(200)
            )
            wrong += int(not np.all(np.asarray(out["h"], np.float32) == 1.5))
        res.add(strategy, wrong)
    res.write()


if __name__ == "__main__":
    main()

"""``auto_mean`` under mpirun: rank 0's profile wins, the choice is the same on
every rank, and the result is the exact mean.

Every rank writes a profile of its own; rank 1's makes every message very
expensive and copies free (so on its own it would pick a different plan than
rank 0's, whose messages are free and copies expensive). Replica ``r`` (rank
x local devices + device) holds ``r + 1`` in every element: the mean over
``R`` replicas is ``(R + 1) / 2``, exact for R a power of two.
"""

import json
import os

from _worker import local_mesh, start, to_numpy


def profile_for(rank):
    from jaxsync.auto import _cost

    if rank == 0:  # free messages, expensive copies: pack nothing
        link = _cost.Link(alpha=0.0, beta=1e-9, gamma=1e-10)
        copy = 1e-6
    else:  # expensive messages, free copies: pack everything
        link = _cost.Link(alpha=1.0, beta=1e-9, gamma=1e-10)
        copy = 0.0
    return _cost.Profile(
        (("device", link), ("host", link)),
        copy,
        {"processes": 2, "hosts": 1, "local_devices": 1},
        "test",
    )


def main():
    ns, jax, comm, rank, size, D, res = start()
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jaxsync
    from jaxsync.auto import _auto, _cost_ops

    mine = os.path.join(ns.out, f"profile-{rank}.json")
    with open(mine, "w") as f:
        json.dump(profile_for(rank).to_json(), f)
    comm.Barrier()

    tree = {f"w{i:02d}": jnp.zeros((64 + i,), jnp.float32) for i in range(24)}
    tree["big"] = jnp.zeros((70_000,), jnp.float32)
    mesh = local_mesh("local")
    tx = jaxsync.auto_mean(axis_name="local", comm=comm, profile=mine)
    res.add("before", tx.describe())

    def body(t):
        g = jax.tree.map(lambda x: x[0], t)
        return jax.tree.map(lambda x: x[None], tx.update(g, tx.init(g))[0])

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("local"), out_specs=P("local")))
    first = rank * D + 1
    stacked = jax.tree.map(
        lambda x: jnp.stack([jnp.full(x.shape, first + d, x.dtype) for d in range(D)]), tree
    )
    out = jax.block_until_ready(step(stacked))
    res.add("result", to_numpy(out))
    res.add("replicas", size * D)
    res.add("describe", tx.describe())
    topo = _cost_ops.ModelTopology(processes=size, hosts=1, local_devices=D)
    want = [_auto.choose(tree, topo, profile_for(r)) for r in range(2)]
    res.add("want", [(c.strategy, c.bucket_bytes, c.pack_threshold) for c in want])
    got = _auto._recent[tx.update.config.auto.key][-1]
    res.add("got", (got.strategy, got.bucket_bytes, got.pack_threshold))
    res.add("note", tx.update.config.auto.note)

    # sync_gradients(strategy="auto") takes the same path (profile= option).
    f = jax.jit(
        jax.shard_map(
            lambda t: jax.tree.map(
                lambda x: x[None],
                jaxsync.sync_gradients(
                    jax.tree.map(lambda x: x[0], t),
                    axis_name="local",
                    comm=comm,
                    strategy="auto",
                    profile=mine,
                ),
            ),
            mesh=mesh,
            in_specs=P("local"),
            out_specs=P("local"),
        )
    )
    res.add("sync_gradients", to_numpy(jax.block_until_ready(f(stacked))))
    res.write()


if __name__ == "__main__":
    main()

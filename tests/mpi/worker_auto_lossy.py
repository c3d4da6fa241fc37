"""``auto_mean(allow_lossy=True)`` under mpirun: on a slow process link the
choice puts bfloat16 on the wire, the same on every rank, and the mean is right
(replica ``r`` holds ``r + 1``: the mean, 1.5 or 2.5, is exact in bfloat16);
without ``allow_lossy`` the same profile keeps float32.
"""

from _worker import local_mesh, start, to_numpy


def slow_link_profile():
    from jaxsync.auto import _cost

    slow = _cost.Link(alpha=1e-5, beta=1e-7, gamma=1e-10, algorithm="ring")  # 80 Mbit/s
    return _cost.Profile(
        (("device", slow), ("host", slow)),
        1e-10,
        {"processes": 2, "hosts": 1, "local_devices": 1},
        "test",
    )


def main():
    _, jax, comm, rank, size, D, res = start()
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jaxsync

    tree = {"big": jnp.zeros((200_000,), jnp.float32), "b": jnp.zeros((300,), jnp.float32)}
    mesh = local_mesh("local")
    first = rank * D + 1
    stacked = jax.tree.map(
        lambda x: jnp.stack([jnp.full(x.shape, first + d, x.dtype) for d in range(D)]), tree
    )
    for name, allow in (("lossy", True), ("lossless", False)):
        tx = jaxsync.auto_mean(
            axis_name="local", comm=comm, profile=slow_link_profile(), allow_lossy=allow
        )

        def body(t, tx=tx):
            g = jax.tree.map(lambda x: x[0], t)
            return jax.tree.map(lambda x: x[None], tx.update(g, tx.init(g))[0])

        step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("local"), out_specs=P("local")))
        res.add(f"{name} result", to_numpy(jax.block_until_ready(step(stacked))))
        res.add(f"{name} describe", tx.describe())
    res.add("replicas", size * D)
    res.write()


if __name__ == "__main__":
    main()

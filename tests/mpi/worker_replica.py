"""replica_mean under mpirun: BatchNorm-like statistics averaged exactly.

Global replica ``g`` (this process's devices numbered after the lower ranks')
holds the batch ``16 g + arange(ROWS * COLS)`` (rows x columns): its batch mean
is ``16 g + c`` and its variance a constant, so the mean over every replica is
exact in float32. The pytest side (test_replica_mpi.py) compares bitwise with
the closed form built from the device counts recorded in ``meta``.

Cases: per-replica statistics under jit(shard_map), vmap and pmap; statistics
already ``pmean``'d over the local axis (typed invariant under shard_map, as
flax's ``BatchNorm(axis_name=...)`` makes them), which must come back as the
same global mean; and, for contrast,
what ``sync_gradients`` gives for the latter. Also ``jaxsync.local_batch`` (the
default ``comm``): this rank's rows of a global batch of 16 (each of its devices
its rows), and the error of a batch of 6 rows.
"""

from _worker import Results, init, to_numpy

ROWS, COLS = 4, 3


def main():
    ns, jax, MPI = init()
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxsync

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    D = jax.local_device_count()
    counts = comm.allgather(D)
    first = sum(counts[:rank])
    res = Results(ns.out, rank)
    res.add("meta", dict(rank=rank, size=comm.Get_size(), devices=D, counts=counts))

    base = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
    x = jnp.asarray(np.stack([base + 16 * (first + d) for d in range(D)]))

    def stats(xb):
        return {"mean": xb.mean(0), "var": xb.var(0), "loss": jnp.sum(xb) / 16}

    mesh = Mesh(np.array(jax.devices()), ("d",))
    put = jax.device_put(x, NamedSharding(mesh, P("d")))

    def sharded(body):
        f = jax.shard_map(lambda xb: body(xb[0]), mesh=mesh, in_specs=P("d"), out_specs=P())
        f = jax.jit(f)
        return to_numpy(jax.block_until_ready(f(put)))

    mean = lambda t: jaxsync.replica_mean(t, axis_name="d", comm=comm)  # noqa: E731
    local = lambda xb: jax.tree.map(lambda a: lax.pmean(a, "d"), stats(xb))  # noqa: E731
    res.add("shard_map", sharded(lambda xb: mean(stats(xb))))
    res.add("shard_map-invariant", sharded(lambda xb: mean(local(xb))))
    res.add(
        "shard_map-invariant-sync_gradients",
        sharded(lambda xb: jaxsync.sync_gradients(local(xb), axis_name="d", comm=comm)),
    )
    res.add("shard_map-local", sharded(local))
    res.add("vmap", to_numpy(jax.jit(jax.vmap(lambda xb: mean(stats(xb)), axis_name="d"))(x)))
    res.add("pmap", to_numpy(jax.pmap(lambda xb: mean(stats(xb)), axis_name="d")(x)))
    mesh = Mesh(np.array(jax.local_devices()), ("d",))
    got = jaxsync.local_batch({"x": np.arange(32.0).reshape(16, 2)}, mesh)["x"]
    res.add("local_batch", [to_numpy(s.data) for s in got.addressable_shards])
    try:
        jaxsync.local_batch({"x": np.zeros((6, 2))}, mesh)
        res.add("local_batch_uneven", None)
    except ValueError as e:
        res.add("local_batch_uneven", str(e))
    res.write()


if __name__ == "__main__":
    main()

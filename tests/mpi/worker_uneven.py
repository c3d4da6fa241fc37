"""Processes with different local device counts (``--devices 2,4``).

Replica ``r`` (numbered across processes: rank 0's devices first) holds ``r``;
with 6 replicas the mean is 2.5. Each strategy's outcome is recorded as
``("OK", values)`` or ``(error type, message)``.
"""

from _worker import Results, init


def main():
    ns, jax, MPI = init()
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jaxsync

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    D = jax.local_device_count()
    first = comm.exscan(D) or 0
    res = Results(ns.out, rank)
    res.add("devices", D)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    x = {"w": jnp.arange(first, first + D, dtype=jnp.float32)[:, None]}
    for name in ("naive", "flat", "hierarchical", "two_dimensional"):
        tx = getattr(jaxsync, f"{name}_mean")(axis_name="d", comm=comm)
        f = jax.jit(
            jax.shard_map(
                lambda t, tx=tx: tx.update(t, tx.init(t))[0],
                mesh=mesh,
                in_specs=P("d"),
                out_specs=P("d"),
            )
        )
        try:
            res.add(name, ("OK", np.asarray(jax.block_until_ready(f(x))["w"])))
        except Exception as e:  # noqa: BLE001
            res.add(name, (type(e).__name__, str(e)))
    res.write()


if __name__ == "__main__":
    main()

"""The host tier in the lowered step: what each strategy issues, with and without it.

For every strategy (1 device per process: plain ``jit``; several: ``shard_map``)
the worker records the custom-call targets of the lowered step and whether its
text is the same as the text lowered with the host tier forced off
(``MPIBackend.tier`` returning None: today's code path, the same communicators).
On one host the two must be equal; across hosts with several processes on a
host, they differ where the tier is used.
"""

import re

from _worker import Results, init


def main():
    ns, jax, MPI = init()
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jaxsync
    from jaxsync._comm import _mpi_backend, _mpi_ops

    comm = MPI.COMM_WORLD
    D = jax.local_device_count()
    res = Results(ns.out, comm.Get_rank())
    res.add("topology", jaxsync.topology(comm).as_dict())
    mesh = Mesh(np.array(jax.devices()), ("d",))
    # "a" is above the 256 KiB packing threshold and below one chunk of the
    # pipelined tier (so the tier is its three calls; worker_pipelined_tier.py
    # has the one call)
    n = _mpi_ops.TIER_CHUNK_BYTES // 4 * 3 // 4
    assert n * 4 > 256 << 10, n
    tree = {
        "a": jnp.ones((D, n), jnp.float32),
        "b": jnp.ones((D, 7), jnp.float32),
        "c": jnp.ones((D, 5), jnp.bfloat16),
    }

    def lowered(strategy, **kw):
        fac = getattr(jaxsync, f"{strategy}_mean")
        tx = fac(axis_name="d", comm=comm, **kw)

        def body(t):
            t = jax.tree_util.tree_map(lambda x: x[0], t)
            out = tx.update(t, tx.init(t))[0]
            return jax.tree_util.tree_map(lambda x: x[None], out)

        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        # every traced synchronisation is a new agreement instance: not compared
        return re.sub(r"agree_instance = \d+", "agree_instance = N", fn.lower(tree).as_text())

    original = _mpi_backend.MPIBackend.tier
    for strategy in ("naive", "flat", "hierarchical", "two_dimensional"):
        for kw, name in (({}, ""), ({"comm_dtype": jnp.bfloat16}, "-bf16")):
            text = lowered(strategy, **kw)
            _mpi_backend.MPIBackend.tier = lambda self, *a, **k: None
            try:
                off = lowered(strategy, **kw)
            finally:
                _mpi_backend.MPIBackend.tier = original
            res.add(f"{strategy}{name}:calls", re.findall(r"custom_call @(jaxsync_\w+)", text))
            res.add(f"{strategy}{name}:same", text == off)
    res.write()


if __name__ == "__main__":
    main()

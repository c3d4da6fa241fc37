"""Rows 10 and 12 (tests/_common.py): a straggler under the watchdog; several syncs in one step.

* ``timeout=1.0``: rank 1 sleeps 3 s before its second step. Rank 0's watchdog
  must report rank 1 as not arrived; every step's result must still be exact.
* Two different transforms (many buckets each, f32 and bf16) in one jitted
  step, several steps: no deadlock, exact results, one compilation.
"""

import time

from _worker import local_mesh, start, to_numpy


def main():
    _, jax, comm, rank, _, d, res = start()
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jaxsync

    mesh = local_mesh("d")
    x = jnp.arange(d, dtype=jnp.float32) + d * rank  # replica r holds r

    # Row 10: straggler and watchdog.
    for strategy in ("hierarchical", "two_dimensional"):
        tx = getattr(jaxsync, f"{strategy}_mean")(axis_name="d", comm=comm, timeout=1.0)

        def f(r, tx=tx):
            t = {"w": jnp.full((5,), r[0])}
            return tx.update(t, tx.init(t))[0]

        g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=P()))
        outs = []
        for step in range(3):
            if rank == 1 and step == 1:
                time.sleep(3.0)
            outs.append(to_numpy(jax.block_until_ready(g(x))["w"]))
        res.add(f"straggler-{strategy}", outs)
    from jaxsync._comm._topology import Comms

    res.add("watchdog-reports", list(Comms.of(comm).watchdog(1.0).reports))

    # Row 12: two syncs, many buckets each, in one compiled step.
    t1 = jaxsync.hierarchical_mean(axis_name="d", comm=comm, bucket_bytes=64, pack_threshold=None)
    t2 = jaxsync.two_dimensional_mean(
        axis_name="d", comm=comm, bucket_bytes=64, pack_threshold=None, comm_dtype=jnp.bfloat16
    )
    traces = []

    def step(r):
        traces.append(1)
        a = {f"a{k}": jnp.full((20,), r[0] + k) for k in range(30)}
        b = {f"b{k}": jnp.full((7,), r[0] - k, jnp.bfloat16) for k in range(30)}
        return t1.update(a, t1.init(a))[0], t2.update(b, t2.init(b))[0]

    g = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("d"), out_specs=P()))
    for _ in range(4):
        a, b = jax.block_until_ready(g(x))
    res.add("two-syncs", (to_numpy(a), to_numpy(b)))
    res.add("two-syncs-traces", len(traces))
    res.write()


if __name__ == "__main__":
    main()

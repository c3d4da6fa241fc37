"""Many buckets in one jitted step, several steps (row 12, tests/_common.py).

50 leaves (f32 and f16, 1-20 elements) with ``bucket_bytes=64,
pack_threshold=None``: dozens of ordered MPI calls per step. Replica
``r = D * rank + d`` adds ``r + k`` to leaf ``k`` of the carried state ``s``
and syncs: ``s_{t+1} = s_t + (N - 1) / 2 + k`` exactly. The steps are chained
through ``s``. Python-side trace counters show whether
step 2 retraced.
"""

from _worker import inter_factories, local_mesh, start, to_numpy

NLEAVES = 50
STEPS = 4


def leaf_specs():
    return [
        (f"l{k:02d}", (1 + (7 * k) % 20,), "float16" if k % 5 == 3 else "float32")
        for k in range(NLEAVES)
    ]


def main():
    _, jax, comm, rank, _, D, res = start()
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxsync

    mesh = local_mesh("d")
    specs = leaf_specs()
    opts = dict(bucket_bytes=64, pack_threshold=None)
    # Placed as the step's outputs are, so step 2 sees exactly step 1's input types.
    zero = jax.device_put(
        {n: jnp.zeros((D, *s), d) for n, s, d in specs}, NamedSharding(mesh, P("d"))
    )
    res.add(
        "buckets",
        len(
            jaxsync.make_plan({n: jax.ShapeDtypeStruct(s, d) for n, s, d in specs}, **opts).buckets
        ),
    )

    for name, fac in inter_factories().items():
        tx = fac(axis_name="d", comm=comm, **opts)
        traces = [0]

        def body(s, tx=tx, traces=traces):
            traces[0] += 1
            s = jax.tree_util.tree_map(lambda x: x[0], s)
            r = (D * rank + jax.lax.axis_index("d")).astype(jnp.float32)
            g = {n: s[n] + (r + k).astype(s[n].dtype) for k, (n, _, _) in enumerate(specs)}
            out = tx.update(g, tx.init(g))[0]
            return jax.tree_util.tree_map(lambda x: x[None], out)

        step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        s = zero
        for _ in range(STEPS):
            # Chained (each step consumes the previous one) and blocked: README,
            # "Fake CPU devices": keep one step in flight on a machine with few cores.
            s = jax.block_until_ready(step(s))
        res.add(name, dict(traces=traces[0], state=to_numpy(s), cache_size=step._cache_size()))
    res.add("specs", specs)
    res.write()


if __name__ == "__main__":
    main()

"""Two synchronisations of mixed-dtype, many-bucket trees in one step, many steps.

Every inter-process call of a traced step takes the token of the previous one,
across synchronisations, so every process issues the calls of both syncs in the
same order (otherwise the all-to-alls of differently sized bf16 buffers would be
matched with the wrong peers' calls: wrong values or a hang).

Replica ``r`` (``r = D * rank + d``) holds at step ``s`` leaf ``k`` of tree A
filled with ``r + k + s`` and leaf ``k`` of tree B with ``r + 2 k + s``; with
``N`` replicas the means are ``(N - 1) / 2 + k + s`` and ``(N - 1) / 2 + 2 k + s``:
integers or halves, exact in float32 and bfloat16 (all values stay below 256).
Modes: ``jit`` (axis_name=None), ``vmap`` and ``shard_map`` over the D local
devices, and ``shard_map-host`` (staging="host"). Records every step's outputs for bitwise
comparison.
"""

from _worker import local_mesh, start, to_numpy

LEAVES_A = 12  # f32 and bf16 leaves alternating
LEAVES_B = 9
STEPS = 8


def main():
    _, jax, comm, rank, size, D, res = start()
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jaxsync

    res.add("meta", dict(rank=rank, size=size, devices=D))

    def dtype(k):
        return jnp.float32 if k % 2 == 0 else jnp.bfloat16

    def trees(r, s):
        """Trees of replica(s) ``r`` (a scalar or a vector of replica ids) at step s."""
        r = jnp.asarray(r, jnp.float32)
        a = {
            f"a{k:02d}": (jnp.full((5 + k,), 1.0) * (r + k + s)).astype(dtype(k))
            for k in range(LEAVES_A)
        }
        b = {
            f"b{k:02d}": (jnp.full((3, 2 + k), 1.0) * (r + 2 * k + s)).astype(dtype(k + 1))
            for k in range(LEAVES_B)
        }
        return a, b

    def make(axis, staging="device"):
        opts = dict(comm=comm, bucket_bytes=32, pack_threshold=None, staging=staging)
        ta = jaxsync.hierarchical_mean(axis_name=axis, **opts)
        tb = jaxsync.two_dimensional_mean(axis_name=axis, **opts)
        tc = jaxsync.flat_mean(axis_name=axis, **opts)

        def step(a, b):
            out_a = ta.update(a, ta.init(a))[0]
            out_b = tb.update(b, tb.init(b))[0]
            # a third sync of tree A with other buckets (flat packs across dtypes
            # differently), after both in the token chain
            out_c = tc.update(a, tc.init(a))[0]
            return out_a, out_b, out_c

        return step

    mesh = local_mesh("d")
    modes = {}
    if D == 1:
        modes["jit"] = (jax.jit(make(None)), lambda s: trees(rank, s))
    modes["vmap"] = (
        jax.jit(jax.vmap(make("d"), axis_name="d")),
        lambda s: jax.vmap(lambda r: trees(r, s))(jnp.arange(D) + D * rank),
    )

    def sharded(staging):
        step = make("d", staging)

        def body(a, b):
            one = lambda t: jax.tree_util.tree_map(lambda x: x[0], t)
            outs = step(one(a), one(b))
            return jax.tree_util.tree_map(lambda x: x[None], outs)

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

    rows = lambda s: jax.vmap(lambda r: trees(r, s))(jnp.arange(D) + D * rank)
    modes["shard_map"] = (sharded("device"), rows)
    # host staging: leader chosen by lax.cond, syncs tied by data
    modes["shard_map-host"] = (sharded("host"), rows)

    import re

    def token_chain(text):
        """(result, target, token operand) of each jaxsync call, and create_tokens."""
        calls = re.findall(
            r"(%[\w]+)(?::\d+)? = stablehlo\.custom_call "
            r"@(jaxsync_\w+)\((%[\w#]+)",
            text,
        )
        return calls, len(re.findall(r"stablehlo\.create_token", text))

    for mode, (fn, data) in modes.items():
        if not mode.endswith("-host"):
            res.add("chain:" + mode, token_chain(fn.lower(*data(0)).as_text()))
        try:
            outs = []
            for s in range(STEPS):
                outs.append(to_numpy(jax.block_until_ready(fn(*data(s)))))
            res.add(mode, outs)
        except Exception as e:  # recorded; pytest fails the case with the message
            import traceback

            res.add(mode, "ERROR: " + "".join(traceback.format_exception(e)))
    res.add("layout", dict(leaves_a=LEAVES_A, leaves_b=LEAVES_B, steps=STEPS))
    res.write()


if __name__ == "__main__":
    main()

"""Exact-by-construction reductions over MPI (row 13, tests/_common.py).

Replica ``r = D * rank + d`` (D local devices) holds leaf ``k`` filled with
``r + k``; with ``N = D * size`` replicas the mean is ``(N - 1) / 2 + k`` and the
sum ``N (N - 1) / 2 + N k``, both exact in f32, bf16 and f16 for the small
values used. Every case records each replica's output (stacked on a leading
axis) for the pytest side to compare bitwise.

Also ``random-*`` cases: random f32 data, compared with the mesh backend.

For the shard_map cases the custom calls of the lowered step are recorded too,
to check that ``staging`` and ``comm_dtype`` really change the transport.

Cases: every strategy x {mean, sum} under jit(shard_map), also with
comm_dtype=bfloat16 (and, asked for by name, other options: see ``made``);
staging="host" for every strategy; vmap for every strategy; pmap for
hierarchical and two_dimensional.
"""

from _worker import inter_factories, local_mesh, start, to_numpy


def main():
    ns, jax, comm, rank, size, D, res = start([(("--cases",), dict(default="all"))])
    import functools
    import re

    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    res.add("meta", dict(rank=rank, size=size, devices=D))

    from mpi_data import LEAVES, make_tree

    local = make_tree(jnp, np, first_replica=D * rank, count=D)
    mesh = local_mesh("d")
    factories = inter_factories()

    def one(tx, t):
        return tx.update(t, tx.init(t))[0]

    def sharded(tx):
        def body(t):
            t = jax.tree_util.tree_map(lambda x: x[0], t)
            out = one(tx, t)
            return jax.tree_util.tree_map(lambda x: x[None], out)

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

    cases = {}
    for name, fac in factories.items():
        for reduce in ("mean", "sum"):
            cases[f"shard_map-{name}-{reduce}"] = functools.partial(
                sharded, fac(axis_name="d", comm=comm, reduce=reduce)
            )
        cases[f"shard_map-{name}-mean-staging_host"] = functools.partial(
            sharded, fac(axis_name="d", comm=comm, staging="host")
        )
        for reduce in ("mean", "sum"):
            cases[f"shard_map-{name}-{reduce}-comm_bf16"] = functools.partial(
                sharded, fac(axis_name="d", comm=comm, reduce=reduce, comm_dtype=jnp.bfloat16)
            )
        tx = fac(axis_name="d", comm=comm)
        cases[f"vmap-{name}-mean"] = functools.partial(
            lambda tx: jax.jit(jax.vmap(functools.partial(one, tx), axis_name="d")), tx
        )
    for name in ("hierarchical", "two_dimensional"):
        tx = factories[name](axis_name="d", comm=comm)
        cases[f"pmap-{name}-mean"] = functools.partial(
            lambda tx: jax.pmap(functools.partial(one, tx), axis_name="d"), tx
        )

    # Random f32 data (the same global tree on every rank, this rank's rows),
    # compared bitwise with the mesh backend by the pytest side.
    from mpi_data import random_tree

    rand = {
        k: jnp.asarray(v[D * rank : D * (rank + 1)]) for k, v in random_tree(np, D * size).items()
    }
    inputs = {}
    for name, fac in factories.items():
        key = f"random-shard_map-{name}-mean"
        cases[key] = functools.partial(sharded, fac(axis_name="d", comm=comm))
        inputs[key] = rand

    def custom_calls(fn, x):
        """(target, operand types) of each custom call in the lowered step."""
        text = fn.lower(x).as_text()
        return [
            (m.group(1), m.group(2))
            for m in re.finditer(r"custom_call @(\w+)\(.*?\)\s.*?:\s*\(([^)]*)\)\s*->", text)
        ]

    def made(key):
        """``shard_map-{strategy}-{reduce}`` with options (``-comm_f32``,
        ``-comm_bf16``; ``-tier_on``/``-tier_off``: ``host_tier=True``/``False``),
        the transform made now (on every rank: the cases are the same)."""
        _, name, reduce, *opts = key.split("-")
        kw = dict(reduce=reduce)
        for o in opts:
            kw |= dict(
                comm_f32=dict(comm_dtype=jnp.float32),
                comm_bf16=dict(comm_dtype=jnp.bfloat16),
                tier_on=dict(host_tier=True),
                tier_off=dict(host_tier=False),
            )[o]
        return functools.partial(sharded, factories[name](axis_name="d", comm=comm, **kw))

    wanted = list(cases) if ns.cases == "all" else ns.cases.split(",")
    for key in wanted:
        try:
            fn = (cases[key] if key in cases else made(key))()
            x = inputs.get(key, local)
            if key.startswith("shard_map-"):
                res.add("calls:" + key, custom_calls(fn, x))
            out = fn(x)
            # Independent jitted syncs must not overlap (README sharp bit).
            out = jax.block_until_ready(out)
            res.add(key, to_numpy(out))
        except Exception as e:  # recorded; pytest fails the case with the message
            import traceback

            res.add(key, "ERROR: " + "".join(traceback.format_exception(e)))
    res.add("leaves", LEAVES)
    res.write()


if __name__ == "__main__":
    main()

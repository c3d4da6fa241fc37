"""broadcast_params(tree, root=1): every process ends with rank 1's values.

Each rank builds leaves whose values depend on its rank (ints, bools, bf16,
f32, a numpy array, a scalar, a zero-size leaf, and a jax.Array sharded over
the local devices) and records what broadcast_params returns.

Then (issue 32) a tree with leaves that are not arrays, as an equinox model
has (a function, Python scalars, a string): the root's scalars, the rest as
they are; a leaf that cannot be broadcast (a jax.ShapeDtypeStruct): the same
TypeError on every rank as in one process; and the warnings of overlap /
double buffering with a communicator of 2 processes (none) and of one
(COMM_SELF: the no-inter-process-stage warning).
"""

from _worker import local_mesh, start


def build(jnp, np, rank, sharding):
    import jax

    return {
        "i32": jnp.arange(5, dtype=jnp.int32) + 100 * rank,
        "u8": jnp.array([rank, 255 - rank], jnp.uint8),
        "bool": jnp.array([rank == 1, rank == 0, True]),
        "bf16": jnp.full((3, 2), rank + 0.5, jnp.bfloat16),
        "f16": jnp.full((2,), -rank - 0.25, jnp.float16),
        "f32": jnp.arange(6, dtype=jnp.float32).reshape(2, 3) / 7 + rank,
        "np_i64": np.arange(3, dtype=np.int64) * (rank + 1),
        "scalar": jnp.float32(rank + 1),
        "empty": jnp.zeros((0, 2), jnp.float32),
        "sharded": jax.device_put(
            jnp.arange(24, dtype=jnp.float32).reshape(4, 6) * (rank + 1), sharding
        ),
        "replicated": jax.device_put(
            jnp.full((3,), rank - 5, jnp.int32), sharding.update(spec=type(sharding.spec)())
        ),
    }


def mixed(jnp, np, rank):
    import jax

    return {
        "w": jnp.arange(3.0) + rank,
        "act": jax.nn.relu,
        "p": 0.5 + rank,
        "n": 10 + rank,
        "flag": rank == 1,
        "np32": np.float32(rank + 0.25),
        "name": "mlp",
    }


def refused(jnp):
    import jax

    return {"w": jnp.ones(2), "spec": jax.ShapeDtypeStruct((2,), jnp.float32)}


def main():
    _, jax, comm, rank, _, _, res = start()
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxsync

    mesh = local_mesh("d")
    sharding = NamedSharding(mesh, P("d"))
    tree = build(jnp, np, rank, sharding)
    out = jaxsync.broadcast_params(tree, root=1, comm=comm)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
    rec = {}
    for name, leaf in out.items():
        before = tree[name]
        info = dict(
            type=type(leaf).__name__,
            type_before=type(before).__name__,
            dtype=str(leaf.dtype),
            shape=tuple(leaf.shape),
            value=np.asarray(leaf),
        )
        if isinstance(leaf, jax.Array):
            info["same_sharding"] = bool(leaf.sharding == before.sharding)
            info["shards"] = [
                (str(s.device), tuple((i.start, i.stop) for i in s.index), np.asarray(s.data))
                for s in leaf.addressable_shards
            ]
        rec[name] = info
    res.add("out", rec)
    # The tree passed in is not modified.
    res.add(
        "input_unchanged",
        all(
            np.array_equal(np.asarray(tree[k]), np.asarray(build(jnp, np, rank, sharding)[k]))
            for k in tree
        ),
    )
    try:
        got = jaxsync.broadcast_params(mixed(jnp, np, rank), root=1, comm=comm)
        res.add(
            "mixed",
            {
                k: (type(v).__name__, np.asarray(v) if k in ("w", "np32") else v)
                for k, v in got.items()
                if k != "act"
            }
            | {"act_is_relu": got["act"] is jax.nn.relu},
        )
    except Exception as e:  # recorded: the test names it
        res.add("mixed", f"{type(e).__name__}: {e}")
    try:
        jaxsync.broadcast_params(refused(jnp), root=1, comm=comm)
        res.add("refused", "no error")
    except TypeError as e:
        res.add("refused", str(e))
    import warnings

    from mpi4py import MPI

    for name, c in (("warnings_world", comm), ("warnings_self", MPI.COMM_SELF)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            jaxsync.hierarchical_mean(None, c, overlap=True, double_buffering=True)
        res.add(name, [str(w.message) for w in seen])
    res.write()


if __name__ == "__main__":
    main()

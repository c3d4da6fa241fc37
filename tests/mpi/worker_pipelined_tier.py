"""The pipelined host tier (``jaxsync_tier``) against the tier's three calls.

Run as 4 processes faked into 2 hosts x 2 (``JAXSYNC_TESTING_HOSTS``, ``--hosts``), the
host tier forced on, ``--devices`` local devices each. Every case syncs the same
integer-valued tree twice: with a 64-byte chunk (the leaves cut into chunks,
chunk boundaries inside a leaf, a leaf smaller than a chunk, an empty leaf: one
``jaxsync_tier`` call) and with the chunk larger than the tree (the tier's three
calls, as before). Recorded per case: both results, and the custom calls of
each lowered step; and the timeline of one pipelined step. Replica ``r``
(process-major) holds ``VALUE(r, i)`` at element ``i``.
"""

import json
import os
import re

from _worker import Results, init

SIZES = {"a": 37, "b": 5, "c": 0, "d": 70}
CASES = (
    ("flat", "sum", "f32"),
    ("flat", "mean", "f32"),
    ("flat", "sum", "bf16"),
    ("flat", "mean", "bf16"),
    ("hierarchical", "sum", "bf16"),
    ("two_dimensional", "sum", "f32"),
    ("two_dimensional", "mean", "bf16"),
    ("two_dimensional", "sum", "bf16"),
)


def value(np, replica, n):
    """Integer values; the bf16 sums of a host exceed 256, so they round."""
    i = np.arange(n)
    return (200 + 37 * replica + (i * 7) % 29).astype(np.float32)


def main():
    ns, jax, MPI = init([(("--hosts",), dict(default="2"))])
    os.environ["JAXSYNC_TESTING_HOSTS"] = ns.hosts  # before jaxsync reads the topology
    os.environ["JAXSYNC_HOST_TIER"] = "1"
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jaxsync
    from jaxsync._comm import _mpi_ops

    comm = MPI.COMM_WORLD
    rank, D = comm.Get_rank(), jax.local_device_count()
    res = Results(ns.out, rank)
    reps = [rank * D + d for d in range(D)]
    tree = {k: np.stack([value(np, r, n) for r in reps]) for k, n in SIZES.items()}
    mesh = Mesh(np.array(jax.devices()), ("d",))

    def step(strategy, reduce, dtype):
        fac = getattr(jaxsync, f"{strategy}_mean")
        wire = jnp.bfloat16 if dtype == "bf16" else None
        if D == 1:
            tx = fac(axis_name=None, comm=comm, reduce=reduce, comm_dtype=wire)
            one = lambda t: tx.update(t, tx.init(t))[0]
            return jax.jit(
                lambda t: jax.tree_util.tree_map(
                    lambda x: x[None], one(jax.tree_util.tree_map(lambda x: x[0], t))
                )
            )
        tx = fac(axis_name="d", comm=comm, reduce=reduce, comm_dtype=wire)

        def body(t):
            t = jax.tree_util.tree_map(lambda x: x[0], t)
            out = tx.update(t, tx.init(t))[0]
            return jax.tree_util.tree_map(lambda x: x[None], out)

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

    # The sums across hosts cut into 12-byte pieces (PIECE_BYTES): piece boundaries
    # inside the leaves of the three-call path, whose results must not change
    _mpi_ops.PIECE_BYTES = 12
    for strategy, reduce, dtype in CASES:
        name = f"{strategy}-{reduce}-{dtype}"
        for chunk, path in ((64, "pipelined"), (1 << 30, "calls")):
            _mpi_ops.TIER_CHUNK_BYTES = chunk
            fn = step(strategy, reduce, dtype)
            text = fn.lower(tree).as_text()
            res.add(
                f"{name}:{path}:calls", sorted(set(re.findall(r"custom_call @(jaxsync_\w+)", text)))
            )
            res.add(f"{name}:{path}:pieces", sorted(set(re.findall(r"piece_bytes = (\d+)", text))))
            out = jax.block_until_ready(fn(tree))
            res.add(f"{name}:{path}", {k: np.asarray(v) for k, v in out.items()})
    # Leaves of two dtypes, 30 bytes in all (two chunks, but less than one
    # chunk's bytes): the three calls, as before.
    _mpi_ops.TIER_CHUNK_BYTES = 64
    small = {"b": tree["b"], "e": jnp.asarray(tree["b"]).astype(jnp.bfloat16)}
    fn = step("flat", "sum", "f32")
    res.add(
        "small:calls",
        sorted(set(re.findall(r"custom_call @(jaxsync_\w+)", fn.lower(small).as_text()))),
    )
    res.add("small", np.asarray(jax.block_until_ready(fn(small))["b"]))
    # The pipelined call in the timeline: one event of kind "tier"
    _mpi_ops.TIER_CHUNK_BYTES = 64
    fn = step("hierarchical", "sum", "f32")
    jax.block_until_ready(fn(tree))  # compiled before the timeline starts
    with jaxsync.timeline(os.path.join(ns.out, f"timeline{rank}")) as tl:
        with tl.step("tier"):
            jax.block_until_ready(fn(tree))
    doc = json.loads(tl.path.read_text())
    res.add(
        "timeline",
        [
            (e["name"], e["args"]["communicator"], e["args"]["bytes"], e["args"]["call"])
            for e in doc["traceEvents"]
            if e.get("cat") == "communication"
        ],
    )
    res.write()


if __name__ == "__main__":
    main()

"""jaxsync's native MPI FFI targets, exact by construction.

Replica ``r = D * rank + d`` holds leaf ``k`` (float16, bfloat16, float32 and
float64 leaves; float64 with jax_enable_x64) filled with ``r + k``: the mean over
``N`` replicas is ``(N - 1) / 2 + k`` exactly. One compiled step runs four
synchronisations (naive, flat, hierarchical, two_dimensional) of that tree.

Also: the native allreduce called directly on float32 / float64 / int32 buffers
in one call, and on random bfloat16 / float16 buffers against a float32
reference; its error for a dtype it does not take; and the compiled HLO of a
hierarchical sync: one in-place MPI call for all buffers, no conditional, and
(one device per process) no copy, no XLA all-reduce.
"""

from _worker import Results, init, to_numpy

LEAVES = (
    ("f16", "float16", (3,)),
    ("bf16", "bfloat16", (2, 3)),
    ("f32", "float32", (5,)),
    ("f64", "float64", (4,)),
    ("f32b", "float32", (7,)),
    ("bf16b", "bfloat16", (1,)),
)
STRATEGIES = ("naive", "flat", "hierarchical", "two_dimensional")


def main():
    ns, jax, MPI = init()
    jax.config.update("jax_enable_x64", True)
    import re

    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jaxsync
    from jaxsync._comm import _mpi_load, _native_prim

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    D = jax.local_device_count()
    res = Results(ns.out, rank)
    res.add("meta", dict(rank=rank, size=size, devices=D))
    res.add("status", _mpi_load.native_status())

    def tree(r):
        return {
            name: (jnp.ones(shape, jnp.float32) * (r + k)).astype(jnp.dtype(dt))
            for k, (name, dt, shape) in enumerate(LEAVES)
        }

    txs = {s: getattr(jaxsync, f"{s}_mean")(axis_name="d", comm=comm) for s in STRATEGIES}

    def step(t):
        return {s: tx.update(t, tx.init(t))[0] for s, tx in txs.items()}

    mesh = Mesh(np.array(jax.devices()), ("d",))

    def body(t):
        t = jax.tree_util.tree_map(lambda x: x[0], t)
        return jax.tree_util.tree_map(lambda x: x[None], step(t))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    x = jax.vmap(tree)(jnp.arange(D, dtype=jnp.float32) + D * rank)

    def attempt(key, fn):
        try:
            res.add(key, fn())
        except Exception as e:  # recorded; pytest fails the case with the message
            import traceback

            res.add(key, "ERROR: " + "".join(traceback.format_exception(e)))

    attempt("shard_map", lambda: [to_numpy(jax.block_until_ready(f(x))) for _ in range(3)])
    g = jax.jit(jax.vmap(step, axis_name="d"))
    attempt("vmap", lambda: to_numpy(jax.block_until_ready(g(x))))

    # The primitive itself: three dtypes summed in one call, world communicator.
    handle = comm.py2f()

    def direct(a, b, c):
        tok, ys = _native_prim.native_call(
            "allreduce", [a, b, c], jax.lax.create_token(), jnp.int32(handle), jnp.int32(1), size
        )
        return ys

    bufs = (
        jnp.full((4,), rank + 1.0, jnp.float32),
        jnp.full((3,), rank + 0.5, jnp.float64),
        jnp.full((5,), rank + 2, jnp.int32),
    )
    attempt("direct", lambda: to_numpy(jax.jit(direct)(*bufs)))

    def bad(a):
        tok, ys = _native_prim.native_call(
            "allreduce", [a], jax.lax.create_token(), jnp.int32(handle), jnp.int32(1), size
        )
        return ys[0]

    try:
        jax.block_until_ready(jax.jit(bad)(jnp.ones(3, jnp.complex64)))
        res.add("bad-dtype", "no error")
    except Exception as e:
        res.add("bad-dtype", str(e))

    # 16-bit floats summed by the native allreduce: random values of every rank
    # (rank r's from seed r, so each rank can build the reference), several
    # buffers of odd sizes past the target's 1 Mi-element chunk, bfloat16 and
    # float16 and float32 in one call. Reference: float32 left fold in rank
    # order, rounded once to nearest even (ml_dtypes' cast).
    sizes = {"bfloat16": (1, 300_001, 1_000_003, 17) + (15_999,) * 70, "float16": (5, 1_200_000)}

    def values(r, dt, n, i):
        g = np.random.default_rng([r, n, i])
        scale = 1e4 if dt == "bfloat16" else 30.0
        v = (g.standard_normal(n) * scale).astype(np.float32)
        v[: n // 50] = np.float32(2.0**-20) * g.standard_normal(n // 50)  # tiny, subnormal in f16
        return v.astype(jnp.dtype(dt))

    low = [(dt, n, i) for dt, ns_ in sizes.items() for i, n in enumerate(ns_)]
    mine = [jnp.asarray(values(rank, dt, n, i)) for dt, n, i in low]
    mine.append(jnp.full((3,), rank + 0.25, jnp.float32))

    def direct16(*xs):
        tok, ys = _native_prim.native_call(
            "allreduce", list(xs), jax.lax.create_token(), jnp.int32(handle), jnp.int32(1), size
        )
        return ys

    def reference():
        out = []
        for dt, n, i in low:
            acc = values(0, dt, n, i).astype(np.float32)
            for r in range(1, size):
                acc = acc + values(r, dt, n, i).astype(np.float32)
            out.append(acc.astype(jnp.dtype(dt)))
        out.append(np.full((3,), sum(r + 0.25 for r in range(size)), np.float32))
        return out

    attempt("direct16", lambda: dict(got=to_numpy(jax.jit(direct16)(*mine)), want=reference()))

    # Compiled HLO of one hierarchical sync of the whole tree (16-bit leaves too).
    def one_sync(tx):
        def body(t):
            t = jax.tree_util.tree_map(lambda x: x[0], t)
            out = tx.update(t, tx.init(t))[0]
            return jax.tree_util.tree_map(lambda x: x[None], out)

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

    def hlo(step, **counts):
        """The compiled step's jaxsync_allreduce calls, the copies of its ENTRY
        computation (fusions may copy inside; the step must not), its text, and
        how often each regex of ``counts`` occurs in it."""
        text = step.lower(x).compile().as_text()
        return dict(
            calls=len(re.findall(r'custom_call_target="jaxsync_allreduce"', text)),
            copy=_copies(text[text.index("ENTRY") :]),
            text=text,
            **{k: len(re.findall(pattern, text)) for k, pattern in counts.items()},
        )

    h = one_sync(jaxsync.hierarchical_mean(axis_name="d", comm=comm))
    rec = hlo(h, conditional=r"\bconditional\(", all_reduce=r"\ball-reduce\(")
    rec["aliasing"] = "output_to_operand_aliasing" in rec["text"]
    # Any effect (an io_callback, an ordered MPI primitive) puts jit's dispatch
    # on its slow path: tens of microseconds per output of the step.
    rec["effects"] = [str(e) for e in h.trace(x).jaxpr.effects] + [
        str(e) for e in f.trace(x).jaxpr.effects
    ]
    res.add("hlo", rec)
    attempt("hlo-run", lambda: to_numpy(jax.block_until_ready(h(x))))

    # flat: with one device per process the native target packs the leaves (no
    # XLA concatenate, slice or copy around its one call).
    hf = one_sync(jaxsync.flat_mean(axis_name="d", comm=comm))
    res.add("hlo-flat", hlo(hf, concatenate=r"\bconcatenate\("))
    res.write()


def _copies(entry: str) -> int:
    """Copies in the step's entry computation, less those of its own parameters:
    an in-place call on a parameter the caller keeps (not donated) needs one
    pass over it, which XLA writes as a copy (jax 0.11-0.12) or folds into a
    fusion (jax 0.10); jaxsync must add none."""
    import re

    params = set(re.findall(r"%(\S+) = \S+ parameter\(", entry))
    return sum(1 for c in re.findall(r"\bcopy\(%([^)\s,]+)\)", entry) if c not in params)


if __name__ == "__main__":
    main()

"""jaxsync's native MPI FFI targets, exact by construction.

Replica ``r = D * rank + d`` holds leaf ``k`` (float16, bfloat16, float32 and
float64 leaves; float64 with jax_enable_x64) filled with ``r + k``: the mean over
``N`` replicas is ``(N - 1) / 2 + k`` exactly. One compiled step runs four
synchronisations (naive, flat, hierarchical, two_dimensional) of that tree.

Also: the native allreduce called directly on float32 / float64 / int32 buffers
in one call, its error for a dtype it does not take, and (one device per
process) the compiled HLO of a hierarchical sync: one in-place MPI call for all
32/64-bit buffers, no conditional, no copy, no XLA all-reduce.
"""

from _worker import Results, init, to_numpy

LEAVES = (("f16", "float16", (3,)), ("bf16", "bfloat16", (2, 3)), ("f32", "float32", (5,)),
          ("f64", "float64", (4,)), ("f32b", "float32", (7,)), ("bf16b", "bfloat16", (1,)))
STRATEGIES = ("naive", "flat", "hierarchical", "two_dimensional")


def main():
    ns, jax, MPI = init()
    jax.config.update("jax_enable_x64", True)
    import re

    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    import jaxsync
    from jaxsync import _mpi

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    D = jax.local_device_count()
    res = Results(ns.out, rank)
    res.add("meta", dict(rank=rank, size=size, devices=D))
    res.add("status", _mpi.native_status())

    def tree(r):
        return {name: (jnp.ones(shape, jnp.float32) * (r + k)).astype(jnp.dtype(dt))
                for k, (name, dt, shape) in enumerate(LEAVES)}

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
        tok, ys = _mpi.native_call("allreduce", [a, b, c], jax.lax.create_token(),
                                   jnp.int32(handle), jnp.int32(1), size)
        return ys

    bufs = (jnp.full((4,), rank + 1.0, jnp.float32), jnp.full((3,), rank + 0.5, jnp.float64),
            jnp.full((5,), rank + 2, jnp.int32))
    attempt("direct", lambda: to_numpy(jax.jit(direct)(*bufs)))

    def bad(a):
        tok, ys = _mpi.native_call("allreduce", [a], jax.lax.create_token(),
                                   jnp.int32(handle), jnp.int32(1), size)
        return ys[0]

    try:
        jax.block_until_ready(jax.jit(bad)(jnp.ones(3, jnp.float16)))
        res.add("bad-dtype", "no error")
    except Exception as e:
        res.add("bad-dtype", str(e))

    # Compiled HLO of one hierarchical sync of 32/64-bit leaves.
    wide = {k: v for k, v in x.items() if v.dtype in (jnp.float32, jnp.float64)}
    tx = jaxsync.hierarchical_mean(axis_name="d", comm=comm)

    def one(t):
        t = jax.tree_util.tree_map(lambda x: x[0], t)
        out = tx.update(t, tx.init(t))[0]
        return jax.tree_util.tree_map(lambda x: x[None], out)

    h = jax.jit(jax.shard_map(one, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    text = h.lower(wide).compile().as_text()
    entry = text[text.index("ENTRY"):]  # fusions may copy inside; the step must not
    res.add("hlo", dict(
        calls=len(re.findall(r'custom_call_target="jaxsync_allreduce"', text)),
        conditional=len(re.findall(r"\bconditional\(", text)),
        copy=len(re.findall(r"\bcopy\(", entry)),
        all_reduce=len(re.findall(r"\ball-reduce\(", text)),
        aliasing="output_to_operand_aliasing" in text,
        # Any effect (an io_callback, an ordered MPI primitive) puts jit's dispatch
        # on its slow path: tens of microseconds per output of the step.
        effects=[str(e) for e in h.trace(wide).jaxpr.effects]
        + [str(e) for e in f.trace(x).jaxpr.effects],
        text=text))
    attempt("hlo-run", lambda: to_numpy(jax.block_until_ready(h(wide))))
    res.write()


if __name__ == "__main__":
    main()

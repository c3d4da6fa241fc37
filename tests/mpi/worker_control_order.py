"""A synchronisation inside control flow (``lax.cond``, ``lax.scan``,
``lax.while_loop``) and one outside it in the same step, in programs that
differ per rank.

Rank 0 makes the gradients late (a long rank-only computation before them)
and the metric early; rank 1 the other way round. In trace order the step
runs the control-flow sync first and ``replica_mean`` of the metric after it on
every rank, but nothing but jaxsync's token chain says so to XLA: without it
each rank's compiled program runs whichever call is ready first, and the two
ranks wait for each other in different collectives (a hang).

Replica ``r`` (``r = D * rank + d``) has gradient leaf ``k`` filled with
``r + k + s`` at step ``s`` and metric ``r + s``: with ``N`` replicas the means
are ``(N - 1) / 2 + k + s`` and ``(N - 1) / 2 + s`` (halves: exact in float32);
a first ``replica_mean`` of ``r + s + 1`` runs before the control flow.
Modes: ``multisteps`` (``optax.MultiSteps`` around the chain: its update runs
inside ``lax.cond``), ``cond``, ``scan`` and ``while`` (the sync inside the
body of each), each under ``shard_map`` over the D local devices (``jit`` with
``axis_name=None`` when D == 1).
"""

from _worker import Results, init, to_numpy

LEAVES = 3
STEPS = 4


CALLS = ("jaxsync_native", "jaxsync_mpi")  # the native target's calls, mpi4jax's


def _calls(jaxprs) -> bool:
    from jax._src import core

    return any(
        e.primitive.name in CALLS or _calls(core.jaxprs_in_params(e.params))
        for j in jaxprs
        for e in j.eqns
    )


def call_names(jaxprs) -> set:
    """The names of the inter-process calls the step makes (at any depth)."""
    from jax._src import core

    out = set()
    for j in jaxprs:
        for e in j.eqns:
            if e.primitive.name in CALLS:
                out.add(e.primitive.name)
            out |= call_names(core.jaxprs_in_params(e.params))
    return out


def unordered(closed):
    """Pairs of the step's synchronising operations (native calls and control-flow
    operations holding one) of which the later does not depend on the earlier:
    one token chain means there are none."""
    from jax._src import core

    jaxpr = closed.jaxpr
    # Down to the step's body (past jit, shard_map): the first level with a call
    # or more than one operation holding calls (mpi4jax's leader conds).
    while True:
        holding = [e for e in jaxpr.eqns if _calls(core.jaxprs_in_params(e.params))]
        if any(e.primitive.name in CALLS for e in jaxpr.eqns) or len(holding) != 1:
            break
        (jaxpr,) = [j for j in core.jaxprs_in_params(holding[0].params) if _calls([j])]
    deps, ops = {}, []
    for i, e in enumerate(jaxpr.eqns):
        d = {i}.union(*(deps.get(v, set()) for v in e.invars if isinstance(v, core.Var)))
        for v in e.outvars:
            deps[v] = d
        if e.primitive.name in CALLS or _calls(core.jaxprs_in_params(e.params)):
            ops.append((i, e.primitive.name, d))
    return [(a[1], b[1]) for k, a in enumerate(ops) for b in ops[k + 1 :] if a[0] not in b[2]]


def main():
    ns, jax, MPI = init([(("--modes",), dict(default="multisteps,cond,scan,while"))])
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax import lax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jaxsync

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    D = jax.local_device_count()
    axis = "d" if D > 1 else None
    res = Results(ns.out, rank)
    res.add("meta", dict(rank=rank, size=comm.Get_size(), devices=D))

    def slow(x):
        """x, after a rank-only computation XLA cannot skip (adds 0 * result)."""
        v = lax.fori_loop(
            0, 300, lambda i, v: jnp.sin(v) * 1.0001 + 0.5, jnp.ones((64,)) + jnp.sum(x)
        )
        return x + 0.0 * jnp.sum(v) * jnp.isnan(jnp.sum(v))

    def grads_of(r, s):
        return {f"g{k}": jnp.full((5 + k,), 1.0) * (r + k + s) for k in range(LEAVES)}

    def vary(tree):
        if axis is None:
            return tree
        return jax.tree_util.tree_map(lambda x: lax.pcast(x, (axis,), to="varying"), tree)

    mean = lambda: jaxsync.hierarchical_mean(axis_name=axis, comm=comm)

    def make(mode):
        if mode == "multisteps":
            tx = optax.MultiSteps(optax.chain(mean(), optax.sgd(1.0)), every_k_schedule=1)
        else:
            tx = mean()

        def step(r, s):
            g = grads_of(r, s)
            m = r + s
            if rank == 0:
                g = jax.tree_util.tree_map(slow, g)
            else:
                m = slow(m)
            state = tx.init(g)
            first = jaxsync.replica_mean(m + 1.0, axis_name=axis, comm=comm)
            # The mean is the same on every device (typed invariant under shard_map):
            # a loop's carry and a cond's other branch are varying.
            sync = lambda g: vary(tx.update(g, state)[0])
            if mode in ("multisteps",):
                out, _ = tx.update(g, state, g)
                out = jax.tree_util.tree_map(lambda u: -u, out)  # sgd(1.0) negates
            elif mode == "cond":
                out = lax.cond(s >= 0, sync, lambda g: g, g)
            elif mode == "scan":
                out, _ = lax.scan(lambda c, _: (sync(c), None), g, None, length=1)
            else:  # while: one iteration
                out = lax.while_loop(lambda c: c[0] < 1, lambda c: (c[0] + 1, sync(c[1])), (0, g))[
                    1
                ]
            metric = jaxsync.replica_mean(m, axis_name=axis, comm=comm)
            return out, first, metric

        if axis is None:
            f = lambda s: step(jnp.float32(rank), s)
            return jax.jit(f), jax.make_jaxpr(f)(jnp.float32(0))
        mesh = Mesh(np.array(jax.devices()), ("d",))

        def body(r, s):
            return jax.tree_util.tree_map(lambda x: x[None], step(r[0], s))

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d")))
        r = jnp.arange(D, dtype=jnp.float32) + D * rank
        return (lambda s: f(r, s)), jax.make_jaxpr(f)(r, jnp.float32(0))

    for mode in ns.modes.split(","):
        try:
            fn, jaxpr = make(mode)
            res.add("chain:" + mode, unordered(jaxpr))
            res.add("calls:" + mode, sorted(call_names([jaxpr.jaxpr])))
            outs = [to_numpy(jax.block_until_ready(fn(jnp.float32(s)))) for s in range(STEPS)]
            res.add(mode, outs)
        except Exception as e:  # recorded; pytest fails the case with the message
            import traceback

            res.add(mode, "ERROR: " + "".join(traceback.format_exception(e)))
        print(f"rank {rank}: {mode} done", flush=True)
    res.add("layout", dict(leaves=LEAVES, steps=STEPS))
    res.write()


if __name__ == "__main__":
    main()

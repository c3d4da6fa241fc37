"""Ranks that take different paths before a collective get an error, never a hang.

Each case makes one rank do something the other does not (a tree with nothing
to reduce, another dtype, another root, another strategy, a skipped or another
synchronisation, another ``accumulate`` k, weights, ``comm_dtype`` or local-update
configuration); every rank records ``(type, message)`` or ``("OK", value)``.
Cases run in sequence: a case that hangs ends the run through the watchdog
(``--watchdog``: exit code 124). ``--only NAME`` runs one case (to check a case
alone on older code).
"""

from _worker import inter_factories, local_mesh, start


def main():
    ns, jax, comm, rank, _, _, res = start([(("--only",), dict(default=""))])
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    import jaxsync

    mesh = local_mesh("d")
    f32, i32 = jnp.float32, jnp.int32
    mine = lambda a, b: a if rank == 0 else b  # noqa: E731
    factories = inter_factories()

    def attempt(key, fn):
        if ns.only and not key.startswith(ns.only):
            return
        try:
            out = fn()
            res.add(key, ("OK", jax.tree_util.tree_map(np.asarray, out)))
        except Exception as e:  # noqa: BLE001 - the type is part of the result
            res.add(key, (type(e).__name__, str(e)))
        res.write()  # in case the next case hangs

    def sync(tx, tree):
        f = jax.shard_map(
            lambda t: tx.update(t, tx.init(t))[0], mesh=mesh, in_specs=P(), out_specs=P()
        )
        return jax.block_until_ready(jax.jit(f)(tree))

    def sharded_step(tree):
        tx = jaxsync.sharded(optax.sgd(1.0), axis_name="d", comm=comm)
        f = jax.shard_map(
            lambda t: tx.update(t, tx.init(t), t)[0], mesh=mesh, in_specs=P(), out_specs=P()
        )
        return jax.block_until_ready(jax.jit(f)(tree))

    # (item 3) nothing to reduce on rank 0, or an int32 leaf where rank 1 has float32.
    trees = dict(
        empty=({}, {"w": jnp.ones(3, f32)}),
        ints=({"w": jnp.ones(3, i32)}, {"w": jnp.ones(3, f32)}),
    )
    for name, (t0, t1) in trees.items():
        for strategy, make in factories.items():
            tx = make(axis_name="d", comm=comm)
            attempt(f"{name}-{strategy}", lambda: sync(tx, mine(t0, t1)))
    # Host staging's agreement (a host callback) runs with nothing to travel too.
    host = jaxsync.hierarchical_mean(axis_name="d", comm=comm, staging="host")
    attempt("empty-host", lambda: sync(host, mine(*trees["empty"])))
    # sharded refuses rank 0's int32 leaf while tracing (before any check can run):
    # that case is worker_abort.py's (the job ends instead of rank 1 waiting).
    attempt("empty-sharded", lambda: sharded_step(mine(*trees["empty"])))

    # (item 4) broadcast_params with a root that differs.
    attempt(
        "root",
        lambda: jaxsync.broadcast_params({"w": jnp.full(3, rank, f32)}, root=mine(0, 1), comm=comm),
    )

    # (item 11) different strategies on identical trees.
    t = {"w": jnp.ones(3, f32)}
    attempt(
        "strategy",
        lambda: sync(
            mine(jaxsync.hierarchical_mean, jaxsync.flat_mean)(axis_name="d", comm=comm), t
        ),
    )

    # A compiled step that ran and agreed, run again on rank 0 while rank 1 runs
    # another synchronisation: the header is checked on every run, not only the first.
    tx = jaxsync.hierarchical_mean(axis_name=None, comm=comm)
    fa = jax.jit(lambda g: tx.update(g, tx.init(g))[0])
    a, b = {"w": jnp.ones(3, f32)}, {"w": jnp.ones(5, f32)}
    fb = jax.jit(lambda g: tx.update(g, tx.init(g))[0])
    attempt("rerun-first", lambda: fa(a))
    attempt("rerun", lambda: (fa(a) if rank == 0 else fb(b))["w"].block_until_ready())

    # The same synchronisation inside a lax.cond taken alike on every rank, steps
    # 0-3, on 2 local devices: no false alarm, exact sums.
    tx2 = jaxsync.hierarchical_mean(axis_name="d", comm=comm)

    def in_cond(take, g):
        return lax.cond(take, lambda g: tx2.update(g, tx2.init(g))[0], lambda g: g, g)

    stepped = jax.jit(
        jax.shard_map(in_cond, mesh=mesh, in_specs=(P(), P()), out_specs=P())
    )  # fmt: skip
    g = {"w": jnp.full(4, 2.0 * rank + 1, f32)}  # mean over ranks: 2.0
    for i in range(4):
        attempt(f"cond-alike-{i}", lambda: stepped(jnp.bool_(i % 2 == 0), g))

    # (the header's step) optax.apply_if_finite sees a NaN on rank 0 only at step
    # 1: rank 0 skips its sync, rank 1 does not; the next check fails on both.
    opt = optax.apply_if_finite(
        optax.chain(jaxsync.hierarchical_mean(axis_name=None, comm=comm), optax.sgd(1.0)), 5
    )  # fmt: skip
    params = {"w": jnp.ones(3, f32)}
    state = opt.init(params)
    step = jax.jit(lambda g, s: opt.update(g, s, params))
    for i in range(3):
        bad = rank == 0 and i == 1
        grads = {"w": jnp.full(3, jnp.nan if bad else 1.0, f32)}
        key = f"skip-{i}"
        attempt(key, lambda: step(grads, state)[0])
        if res.data.get(key, ("OK",))[0] != "OK":
            break

    # The entry points added since: each case stops at its first error.
    def steps(key, n, fn):
        for i in range(n):
            attempt(f"{key}-{i}", lambda: fn(i))
            if res.data.get(f"{key}-{i}", ("OK",))[0] != "OK":
                return

    w1 = {"w": jnp.ones(3, f32)}

    def jit_steps(tx, grads, params=w1, **extra):  # plain jit, one device
        st, f = [], jax.jit(lambda g, s: tx.update(g, s, params, **extra))

        def one(i):  # the state made on the first call (an error is the case's)
            st[:] = st or [tx.init(params)]
            u, st[0] = f(grads(i), st[0])
            return u

        return one

    def smap_steps(tx, grads):  # shard_map over both devices, P("d") gradients
        specs = jaxsync.state_specs(jax.eval_shape(tx.init, w1), "d")
        init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
        st, f = [], jax.jit(
            jax.shard_map(
                lambda g, s: tx.update(g, s, w1),
                mesh=mesh, in_specs=(P("d"), specs), out_specs=(P(), specs),
            )
        )  # fmt: skip

        def one(i):
            st[:] = st or [init(w1)]
            u, st[0] = f(grads(i), st[0])
            return u

        return one

    def mean_then(opt, c=comm, **kw):
        return optax.chain(jaxsync.hierarchical_mean(axis_name=None, comm=c, **kw), opt)

    def ones(i):
        return {"w": jnp.full(3, 1.0 + i, f32)}

    # (accumulate) a different k on each rank.
    acc_k = jaxsync.accumulate(mean_then(optax.sgd(1.0)), mine(2, 3), axis_name=None)
    steps("acc-k", 3, jit_steps(acc_k, ones))
    # (accumulate) a NaN micro-step on rank 0 only, apply_if_finite after the mean:
    # the whole accumulated step is skipped on both ranks, the next one applies.
    acc_nan = jaxsync.accumulate(
        mean_then(optax.apply_if_finite(optax.sgd(1.0), 3)), 2, axis_name=None
    )

    def nan0(i):
        return {"w": jnp.full(3, jnp.nan if (rank, i) == (0, 0) else 1.0 + i, f32)}

    steps("acc-nan", 4, jit_steps(acc_nan, nan0))

    # (sharded accumulate=k) a different k on each rank, 2 devices each.
    def grads2(i):  # (3,) on each device
        return {"w": jnp.full(6, 1.0 + i, f32)}

    zk = jaxsync.sharded(optax.sgd(1.0), axis_name="d", comm=comm, accumulate=mine(2, 3))
    steps("zero2-k", 3, smap_steps(zk, grads2))
    # (sharded accumulate=2) a NaN micro-step on rank 0's device 0, inside
    # jaxsync.apply_if_finite: dropped on both ranks (accumulator and count kept).
    zn = jaxsync.apply_if_finite(
        jaxsync.sharded(optax.sgd(1.0), axis_name="d", comm=comm, accumulate=2, check_finite=True),
        3,
        axis_name="d",
        comm=comm,
    )

    def nan2(i):
        return {"w": grads2(i)["w"].at[0].set(jnp.nan if (rank, i) == (0, 0) else 1.0 + i)}

    steps("zero2-nan", 3, smap_steps(zn, nan2))
    # (weights) weights=True on rank 0 only.
    wt = mean_then(optax.sgd(1.0), weights=mine(True, False))
    steps("weights", 1, jit_steps(wt, ones, weight=jnp.float32(1.0), done=jnp.bool_(False)))
    # ... and on a compressor (its weights sum first, in a sync of their own).
    ws = optax.chain(jaxsync.sign_mean(None, comm, weights=mine(True, False)), optax.sgd(1.0))
    steps("weights-sign", 1, jit_steps(ws, ones, weight=jnp.float32(1.0), done=jnp.bool_(False)))
    # (comm_dtype) Quantized on rank 0, float32 on rank 1; two blocks.
    q8 = jaxsync.Quantized(bits=8, block=2)
    for key, cd in (
        ("quant-f32", mine(q8, None)),
        ("quant-block", mine(q8, jaxsync.Quantized(bits=8, block=4))),
    ):
        steps(key, 1, jit_steps(mean_then(optax.sgd(1.0), comm_dtype=cd), ones))
    # (local) another outer optimizer (its state's structure), another fragments.
    isl = jaxsync.islands("process", axis_name=None, comm=comm)
    outer = mine(optax.sgd(0.5), optax.sgd(0.5, momentum=0.5))
    lo = jaxsync.diloco(mean_then(optax.sgd(0.5), isl.comm), outer, every=2, islands=isl)
    steps("local-outer", 2, jit_steps(lo, ones))
    # The same outer optimizer with another learning rate (the state alike).
    lr = jaxsync.diloco(
        mean_then(optax.sgd(0.5), isl.comm), optax.sgd(mine(0.5, 0.25)), every=2, islands=isl
    )
    steps("local-outer-lr", 2, jit_steps(lr, ones))
    frag = jaxsync.diloco(
        mean_then(optax.sgd(0.5), isl.comm), optax.sgd(0.5), every=2, fragments=mine(1, 2),
        islands=isl,
    )  # fmt: skip
    wv = {"w": jnp.ones(3, f32), "v": jnp.ones(2, f32)}
    steps("local-fragments", 2, jit_steps(frag, lambda i: {**ones(i), "v": wv["v"]}, wv))

    # Still in step after all of that: a matching sync is exact.
    attempt("after", lambda: sync(factories["flat"](axis_name="d", comm=comm), g))
    res.write()


if __name__ == "__main__":
    main()

"""Ranks that take different paths before a collective get an error, never a hang.

Each case makes one rank do something the other does not (a tree with nothing
to reduce, another dtype, another root, another strategy, a skipped or another
synchronisation); every rank records ``(type, message)`` or ``("OK", value)``.
Cases run in sequence: a case that hangs ends the run through the watchdog
(``--watchdog``: exit code 124). ``--only NAME`` runs one case (to check a case
alone on older code).
"""

from _worker import Results, init


def main():
    ns, jax, MPI = init([(("--only",), dict(default=""))])
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax import lax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jaxsync

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    res = Results(ns.out, rank)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    f32, i32 = jnp.float32, jnp.int32
    mine = lambda a, b: a if rank == 0 else b  # noqa: E731
    factories = dict(
        naive=jaxsync.naive_mean,
        flat=jaxsync.flat_mean,
        hierarchical=jaxsync.hierarchical_mean,
        two_dimensional=jaxsync.two_dimensional_mean,
    )

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

    # Still in step after all of that: a matching sync is exact.
    attempt("after", lambda: sync(factories["flat"](axis_name="d", comm=comm), g))
    res.write()


if __name__ == "__main__":
    main()

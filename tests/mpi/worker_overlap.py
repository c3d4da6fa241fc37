"""overlap=True and double_buffering=True under mpirun: exact, ordered, donated.

Records, per mode (``jit``: one device per process, ``axis_name=None``;
``shard_map`` and ``pmap`` over the D local devices; ``vmap``):

* ``same:<mode>``: the parameters after each of STEPS train steps of a small
  MLP (float32 and bfloat16 leaves, many buckets), blocking and overlapped,
  params and state donated: pytest compares them bit for bit.
* ``two:<mode>``: two synchronisations in one step (hierarchical_mean and
  flat_mean, both overlapped with 64-byte buckets: many calls), and the same
  with blocking syncs.
* ``double:<mode>``: double-buffered SGD (``reduce="sum"``, lr 1/16) on
  ``g_r(w) = 2 w + 6 (r + 1)`` (every value dyadic and small: every sum exact
  in any order), the parameters after each step, for pytest to compare with the
  stale-by-one sequence by hand.
* ``resume``: double buffering for 6 steps straight, and 3 steps, the state
  and parameters saved to numpy and restored, 3 more steps with a freshly
  made transform and step: both final parameters.
"""

from _worker import local_mesh, start, to_numpy

STEPS = 4
WIDTH = 24


def main():
    _, jax, comm, rank, size, D, res = start()
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    import jaxsync

    res.add("meta", dict(rank=rank, size=size, devices=D, steps=STEPS))
    mesh = local_mesh("d")

    def mlp_params():
        k = jax.random.PRNGKey(0)
        ps = []
        for i, dt in enumerate([jnp.float32, jnp.bfloat16, jnp.float32, jnp.float32]):
            kw = jax.random.fold_in(k, i)
            ps.append(
                {
                    "w": (jax.random.normal(kw, (WIDTH, WIDTH)) / 5).astype(dt),
                    "b": jnp.full((WIDTH,), 0.01 * i, dt),
                }
            )
        return ps

    def mlp_loss(p, x):
        h = x
        for layer in p:
            h = jnp.tanh(h.astype(layer["w"].dtype) @ layer["w"] + layer["b"])
        return jnp.mean(h.astype(jnp.float32) ** 2)

    def batch(replica, s):
        return jax.random.normal(jax.random.PRNGKey(100 * replica + s), (8, WIDTH))

    def local_batches(s):  # (D, 8, WIDTH): this process's replicas
        return jnp.stack([batch(rank * D + d, s) for d in range(D)])

    def train(mode, txs, loss, params, batches, steps, lr=0.1):
        """Params after each step; ``txs`` synchronise the gradient's halves."""
        opt = optax.chain(*txs, optax.sgd(lr)) if len(txs) == 1 else None

        def update(g, s, p):
            if opt is not None:
                u, s = opt.update(g, s, p)
                return optax.apply_updates(p, u), s
            # two synchronisations: odd layers through txs[0], even through txs[1]
            odd, even = g[1::2], g[0::2]
            uo, s0 = txs[0].update(odd, s[0], p[1::2])
            ue, s1 = txs[1].update(even, s[1], p[0::2])
            u = [None] * len(g)
            u[1::2], u[0::2] = uo, ue
            return jax.tree.map(lambda a, b: a - 0.1 * b, p, u), (s0, s1)

        def init(p):
            if opt is not None:
                return opt.init(p)
            return (txs[0].init(p[1::2]), txs[1].init(p[0::2]))

        def body(p, s, x):
            g = jax.grad(loss)(p, x)
            return update(g, s, p)

        state = init(params)
        if mode == "jit":
            step = jax.jit(body, donate_argnums=(0, 1))
            data = lambda s: batches(s)[0]  # noqa: E731
        elif mode == "shard_map":
            specs = jaxsync.state_specs(state, "d")
            state = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

            def per_device(p, s, x):
                return body(p, s, x[0])

            step = jax.jit(
                jax.shard_map(
                    per_device,
                    mesh=mesh,
                    in_specs=(P(), specs, P("d")),
                    out_specs=(P(), specs),
                ),
                donate_argnums=(0, 1),
            )
            data = batches
        elif mode == "pmap":
            rep = lambda t: jax.tree.map(lambda a: jnp.stack([a] * D), t)  # noqa: E731
            params, state = rep(params), rep(state)
            step = jax.pmap(body, axis_name="d", donate_argnums=(0, 1))
            data = batches
        else:  # vmap: every local replica a row of one program
            rep = lambda t: jax.tree.map(lambda a: jnp.stack([a] * D), t)  # noqa: E731
            params, state = rep(params), rep(state)
            step = jax.jit(jax.vmap(body, axis_name="d"), donate_argnums=(0, 1))
            data = batches
        p = jax.tree.map(jnp.copy, params)
        outs = []
        for s in range(steps):
            p, state = step(p, state, data(s))
            got = to_numpy(jax.block_until_ready(p))
            if mode in ("pmap", "vmap"):  # every local replica has the same
                assert all((a == a[0]).all() for a in jax.tree.leaves(got))
                got = jax.tree.map(lambda a: a[0], got)
            outs.append(got)
        return outs

    axis_of = {"jit": None, "shard_map": "d", "pmap": "d", "vmap": "d"}
    modes = ["jit"] if D == 1 else ["shard_map", "pmap", "vmap"]

    def record(key, fn):
        try:
            res.add(key, fn())
        except Exception as e:  # recorded; pytest fails the case with the message
            import traceback

            res.add(key, "ERROR: " + "".join(traceback.format_exception(e)))

    for mode in modes:
        axis = axis_of[mode]
        # vmap's replicas are rows of one message: then D replicas per process too
        for name, kw in (
            ("blocking", dict(overlap=False)),
            ("overlap", dict(overlap=True, overlap_bucket_bytes=512)),
        ):
            tx = jaxsync.hierarchical_mean(axis, comm, **kw)
            record(
                f"same:{mode}:{name}",
                lambda tx=tx: train(mode, [tx], mlp_loss, mlp_params(), local_batches, STEPS),
            )
        for name, kw in (
            ("blocking", dict(overlap=False)),
            ("overlap", dict(overlap=True, overlap_bucket_bytes=64)),
        ):
            txs = [
                jaxsync.hierarchical_mean(axis, comm, **kw),
                jaxsync.flat_mean(axis, comm, bucket_bytes=256, **kw),
            ]
            record(
                f"two:{mode}:{name}",
                lambda txs=txs: train(mode, txs, mlp_loss, mlp_params(), local_batches, STEPS),
            )

        # double buffering on an exact problem: loss_r(w) = sum(w^2) + 6 (r + 1) sum(w)
        def exact_loss(p, r):
            return sum(jnp.sum(w**2) + 6.0 * (r + 1.0) * jnp.sum(w) for w in p)

        def replicas(s):
            del s
            return jnp.asarray([rank * D + d for d in range(D)], jnp.float32)

        w0 = [jnp.arange(6.0) - 2.0, jnp.arange(4.0) * 2.0]
        for name, kw in (
            ("double", {}),
            ("double+overlap", dict(overlap=True, overlap_bucket_bytes=8)),
        ):
            # reduce="sum": XLA may fuse a mean's division by 3 into the update
            # (one rounding fewer than by hand); the sum and lr 1/16 stay exact.
            tx = jaxsync.hierarchical_mean(axis, comm, reduce="sum", double_buffering=True, **kw)
            record(
                f"{name}:{mode}",
                lambda tx=tx: train(mode, [tx], exact_loss, w0, replicas, 6, lr=1 / 16),
            )

    if D == 1:  # checkpoint and restore between steps (one device per process)

        def resume():
            tx = optax.chain(
                jaxsync.hierarchical_mean(None, comm, double_buffering=True), optax.sgd(0.1)
            )

            def make_step(tx):
                def body(p, s, x):
                    g = jax.grad(mlp_loss)(p, x)
                    u, s = tx.update(g, s, p)
                    return optax.apply_updates(p, u), s

                return jax.jit(body, donate_argnums=(0, 1))

            step = make_step(tx)
            p, s = mlp_params(), tx.init(mlp_params())
            for t in range(6):
                p, s = step(p, s, batch(rank, t))
            straight = to_numpy(jax.block_until_ready(p))
            p, s = mlp_params(), tx.init(mlp_params())
            for t in range(3):
                p, s = step(p, s, batch(rank, t))
            saved = to_numpy(jax.block_until_ready((p, s)))  # the checkpoint
            del p, s
            tx2 = optax.chain(
                jaxsync.hierarchical_mean(None, comm, double_buffering=True), optax.sgd(0.1)
            )
            step2 = make_step(tx2)
            p, s = jax.tree.map(jnp.asarray, saved)
            for t in range(3, 6):
                p, s = step2(p, s, batch(rank, t))
            return straight, to_numpy(jax.block_until_ready(p))

        record("resume", resume)
    res.write()


if __name__ == "__main__":
    main()

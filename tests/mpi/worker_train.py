"""Training parity: 2 processes x D devices vs one process on the whole batch.

A small MLP regression model is trained for ``--steps`` steps with
``optax.chain(jaxsync.<strategy>(axis_name="d", comm=COMM_WORLD), optax.adam(1e-2))``
inside ``jit(shard_map)``; the global batch (64 examples) is split over the
``2 * D`` replicas (replica ``r = D * rank + d`` takes rows ``[r*B, (r+1)*B)``).
Parameters and optimizer state are kept per replica (a leading axis of size D
sharded over "d"), so every replica's copy can be compared.

Rank 0 also trains the reference: plain ``optax.adam(1e-2)`` on the whole
batch in one process. ``hierarchical-sgd`` repeats the hierarchical run with
``optax.sgd(0.1)`` (reference ``reference-sgd``). Each rank records its final parameters, the
sha256 of
their bytes, and the digests of every rank (gathered with mpi4py).
"""

import hashlib

from _worker import local_mesh, start, to_numpy

BATCH = 64
LR = 1e-2
SGD_LR = 0.1


def data(np):
    rng = np.random.default_rng(42)
    x = rng.standard_normal((BATCH, 5)).astype(np.float32)
    w = rng.standard_normal((5, 1)).astype(np.float32)
    y = (np.sin(x @ w) + 0.1 * rng.standard_normal((BATCH, 1))).astype(np.float32)
    return x, y


def init_params(np):
    rng = np.random.default_rng(7)
    return {
        "w1": (rng.standard_normal((5, 16)) / np.sqrt(5)).astype(np.float32),
        "b1": np.zeros(16, np.float32),
        "w2": (rng.standard_normal((16, 1)) / 4).astype(np.float32),
        "b2": np.zeros(1, np.float32),
    }


def loss_fn(jnp, params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


def digest(np, tree):
    import jax

    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(tree):
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(str((a.dtype, a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def main():
    ns, jax, comm, rank, size, D, res = start([(("--steps",), dict(type=int, default=25))])
    import functools

    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxsync

    mesh = local_mesh("d")
    shard = NamedSharding(mesh, P("d"))
    x, y = data(np)
    per = BATCH // (D * size)
    lo = D * rank * per
    local_x = jax.device_put(x[lo : lo + D * per], shard)
    local_y = jax.device_put(y[lo : lo + D * per], shard)
    params0 = init_params(np)
    loss = functools.partial(loss_fn, jnp)

    def stack(tree):  # one copy per local replica, sharded over "d"
        return jax.device_put(
            jax.tree_util.tree_map(
                lambda a: jnp.broadcast_to(jnp.asarray(a), (D, *jnp.shape(a))), tree
            ),
            shard,
        )

    runs = {name: (name, optax.adam(LR)) for name in ("hierarchical", "two_dimensional", "flat")}
    # Adam is invariant to a constant gradient scale (a wrong divisor would not
    # show); plain SGD is not.
    runs["hierarchical-sgd"] = ("hierarchical", optax.sgd(SGD_LR))
    for name, (strategy, opt) in runs.items():
        tx = optax.chain(getattr(jaxsync, f"{strategy}_mean")(axis_name="d", comm=comm), opt)

        def body(params, opt_state, xb, yb, tx=tx):
            params, opt_state = jax.tree_util.tree_map(lambda a: a[0], (params, opt_state))
            grads = jax.grad(loss)(params, xb, yb)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            return jax.tree_util.tree_map(lambda a: a[None], (params, opt_state))

        step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        params = stack(params0)
        opt_state = stack(tx.init(params0))
        for _ in range(ns.steps):
            # One step in flight (README, "Fake CPU devices").
            params, opt_state = jax.block_until_ready(step(params, opt_state, local_x, local_y))
        params = to_numpy(params)
        mine = digest(np, params)
        res.add(name, dict(params=params, digest=mine, digests=comm.allgather(mine)))

    if rank == 0:
        for key, ref_tx in (("reference", optax.adam(LR)), ("reference-sgd", optax.sgd(SGD_LR))):

            @jax.jit
            def ref_step(params, opt_state, ref_tx=ref_tx):
                grads = jax.grad(loss)(params, x, y)
                updates, opt_state = ref_tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state

            params = jax.tree_util.tree_map(jnp.asarray, params0)
            opt_state = ref_tx.init(params)
            losses = [float(loss(params, x, y))]
            for _ in range(ns.steps):
                params, opt_state = ref_step(params, opt_state)
                losses.append(float(loss(params, x, y)))
            res.add(key, dict(params=to_numpy(params), losses=losses, initial=params0))
    res.write()


if __name__ == "__main__":
    main()

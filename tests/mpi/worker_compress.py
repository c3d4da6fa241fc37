"""powersgd_mean and sign_mean under MPI: 2 processes x D devices, shard_map.

A small regression MLP is trained for ``STEPS`` steps with
``optax.chain(<compressor>(axis_name="d", comm=COMM_WORLD), optax.adam(1e-2))``
inside ``jit(shard_map)`` over the local devices, the optimizer state passed
with ``jaxsync.state_specs`` (residuals per device). Replica
``r = D * rank + d`` trains on its own rows of the data. Every device returns
its own copy of the parameters (so the pytest side can compare all replicas
bitwise).

Checkpoint round trip: the same run again, stopped after ``STEPS // 2`` steps,
parameters and optimizer state written with ``numpy.savez`` (one file per
rank), read back into fresh arrays, and continued: the final parameters and
state must equal the uninterrupted run's bit for bit.

Also records whether the lowered step calls jaxsync's native all-gather on
uint8 data (the packed sign bits), and how many host callbacks it has (none:
they would put jit's dispatch on its slow path).

``--mode review`` (issue 27) runs instead, with integer-valued gradients:

* ``host``: ``sign_mean(staging="host")`` under ``jit(shard_map)`` (its
  leader's all-gather runs inside ``lax.cond``), 3 steps, next to the same
  with ``staging="device"``; plus a leaf below ``min_size`` (the exact path
  runs first in the step, so the two syncs are chained); ``host_all``: every
  leaf compressed (the all-gather is the step's only inter-process call).
* ``restore``: after 2 steps rank 0's state is written and every rank
  restores it ("process 0 saves"), then one step; and one step from each
  rank's own state with the residuals zeroed on the other ranks.
"""

import os

from _worker import local_mesh, start, to_numpy

STEPS = 50


def main():
    world = start([(("--mode",), dict(default="train", choices=["train", "review"]))])
    if world.ns.mode == "review":
        return review(world)
    ns, jax, comm, rank, size, D, res = world
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import PartitionSpec as P

    import jaxsync

    res.add("meta", dict(rank=rank, size=size, devices=D))
    mesh = local_mesh("d")

    rng = np.random.default_rng(3)
    x_all = rng.standard_normal((size * D * 16, 12)).astype(np.float32)
    y_all = np.tanh(x_all @ rng.standard_normal((12, 6))).astype(np.float32)
    mine = slice(rank * D * 16, (rank + 1) * D * 16)
    x, y = x_all[mine], y_all[mine]
    params0 = {
        "w1": (rng.standard_normal((12, 32)) / 4).astype(np.float32),
        "b1": np.zeros(32, np.float32),
        "w2": (rng.standard_normal((32, 6)) / 6).astype(np.float32),
        "b2": np.zeros(6, np.float32),
    }

    def loss_fn(p, x, y):
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)

    compressors = {
        "powersgd": lambda: jaxsync.powersgd_mean(
            axis_name="d", comm=comm, rank=2, start_step=5, min_compression_rate=1.0
        ),
        "sign": lambda: jaxsync.sign_mean(axis_name="d", comm=comm, min_size=64),
    }
    for name, make in compressors.items():
        try:
            tx = optax.chain(make(), optax.adam(1e-2))
            specs = jaxsync.state_specs(jax.eval_shape(tx.init, params0), "d")
            init_state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))

            def step(p, s, x, y, tx=tx):
                loss, g = jax.value_and_grad(loss_fn)(p, x, y)
                u, s = tx.update(g, s, p)
                p = optax.apply_updates(p, u)
                own = jax.tree.map(lambda v: jax.lax.pcast(v, "d", to="varying")[None], p)
                return p, s, own, jax.lax.pmean(loss, "d")

            f = jax.jit(
                jax.shard_map(
                    step,
                    mesh=mesh,
                    in_specs=(P(), specs, P("d"), P("d")),
                    out_specs=(P(), specs, P("d"), P()),
                )
            )
            text = f.lower(params0, init_state(params0), x, y).as_text()
            res.add(f"{name}:callbacks", text.count("callback"))
            res.add(
                f"{name}:native_allgather_u8",
                "jaxsync_allgather" in text
                and "xui8>" in text.split("jaxsync_allgather", 1)[-1].split("\n", 1)[0],
            )

            def train(p, s, steps, f=f):
                losses = []
                for _ in range(steps):
                    p, s, own, loss = f(p, s, x, y)
                    jax.block_until_ready(p)
                    losses.append(float(loss))
                return p, s, own, losses

            p, s, own, losses = train(params0, init_state(params0), STEPS)
            res.add(f"{name}:own", to_numpy(own))
            res.add(f"{name}:state", [np.asarray(a) for a in jax.tree.leaves(s)])
            res.add(f"{name}:losses", losses)

            # Checkpoint round trip
            p, s, _, _ = train(params0, init_state(params0), STEPS // 2)
            path = os.path.join(ns.out, f"ckpt-{name}-rank{rank}.npz")
            leaves, treedef = jax.tree_util.tree_flatten((p, s))
            np.savez(path, *[np.asarray(a) for a in leaves])
            del p, s, leaves
            with np.load(path) as z:
                p, s = jax.tree_util.tree_unflatten(
                    treedef, [z[f"arr_{i}"] for i in range(len(z.files))]
                )
            p, s, own, _ = train(p, s, STEPS - STEPS // 2)
            res.add(f"{name}:resumed_own", to_numpy(own))
            res.add(f"{name}:resumed_state", [np.asarray(a) for a in jax.tree.leaves(s)])
        except Exception:
            import traceback

            res.add(f"{name}:error", traceback.format_exc())
    res.write()


def review(world):
    ns, jax, comm, rank, size, D, res = world
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import jaxsync

    res.add("meta", dict(rank=rank, size=size, devices=D))
    mesh = local_mesh("d")
    # replica r = D * rank + d: w = (r + 1) * pattern (mean |w| = 2 (r + 1)), b exact
    pattern = np.array([1, -3, 2, -2, 3, -1, 2, -2], np.float32)
    reps = np.arange(rank * D, (rank + 1) * D)
    grads = {
        "w": ((reps[:, None] + 1) * pattern).astype(np.float32),  # (D, 8)
        "b": (reps[:, None] * np.ones(2)).astype(np.float32),  # (D, 2)
    }
    params = {"w": np.zeros(8, np.float32), "b": np.zeros(2, np.float32)}

    def make(tx):
        specs = jaxsync.state_specs(jax.eval_shape(tx.init, params), "d")
        init_state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))

        def step(g, s):
            u, s = tx.update(jax.tree.map(lambda x: x[0], g), s)
            return jax.tree.map(lambda x: jax.lax.pcast(x, "d", to="varying")[None], u), s

        f = jax.jit(
            jax.shard_map(step, mesh=mesh, in_specs=(P("d"), specs), out_specs=(P("d"), specs))
        )
        return init_state, f

    for name, staging, min_size in (
        ("host", "host", 4),
        ("host_all", "host", 1),
        ("device", "device", 4),
    ):
        try:
            tx = jaxsync.sign_mean(axis_name="d", comm=comm, min_size=min_size, staging=staging)
            init_state, f = make(tx)
            s, outs = init_state(params), []
            for _ in range(3):
                u, s = f(grads, s)
                outs.append(to_numpy(u))
            res.add(f"{name}:outs", outs)
            res.add(f"{name}:residual", np.asarray(s.residual[0]))
        except Exception:
            import traceback

            res.add(f"{name}:error", traceback.format_exc())

    try:
        tx = jaxsync.sign_mean(axis_name="d", comm=comm, min_size=4)
        init_state, f = make(tx)
        s = init_state(params)
        for _ in range(2):
            _, s = f(grads, s)
        leaves, treedef = jax.tree_util.tree_flatten(s)
        path = os.path.join(ns.out, "ckpt-rank0.npz")
        if rank == 0:  # "process 0 saves"
            np.savez(path, *[np.asarray(a) for a in leaves])
        comm.Barrier()
        with np.load(path) as z:  # ... and every process restores that file
            restored = jax.tree_util.tree_unflatten(
                treedef, [z[f"arr_{i}"] for i in range(len(leaves))]
            )
        u_restored, s_restored = f(grads, restored)
        zeroed = s if rank == 0 else s._replace(residual=jax.tree.map(jnp.zeros_like, s.residual))
        u_zeroed, s_zeroed = f(grads, zeroed)
        res.add("restore:own_residual", np.asarray(s.residual[0]))
        res.add("restore:owner", np.asarray(getattr(s, "owner", -1)))
        res.add("restore:restored", to_numpy((u_restored, s_restored)))
        res.add("restore:zeroed", to_numpy((u_zeroed, s_zeroed)))
    except Exception:
        import traceback

        res.add("restore:error", traceback.format_exc())
    res.write()


if __name__ == "__main__":
    main()

"""Trains a small MLP across the cluster's hosts while a fault may hit its link.

``optax.chain(jaxsync.hierarchical_mean(axis_name="d"), optax.sgd(0.1))`` in
``jit(shard_map)``, every replica on its own rows of one fixed batch, ``--steps``
steps with ``--pause`` seconds between them. Before step ``i`` every rank calls
``jaxsync.cluster.mark(f"step-{i}")``, so a fault ``LinkDown(after="step-3")``
falls in the training however long the start-up took. With ``--fault-host H
--fault-step S``, the ranks of host H wait (at most ``--fault-wait`` seconds)
before step S until their link is down, so that step meets the fault even when
the machine is too busy for the cluster to act at once. Writes
``OUT/rank{R}.pkl``: the final parameters, when the training started and ended
on the cluster's clock (``$JAXSYNC_CLUSTER_T0``), and the longest step.
``--timeout``/``--on-timeout`` go to the factory; ``--stall-rank R`` makes rank
R stop calling (sleep in Python) before step ``--stall-at``, printing when on
the cluster's clock.
"""

import os
import time

from _worker import local_mesh, start, to_numpy


def main():
    ns, jax, comm, rank, size, D, res = start(
        [
            (("--steps",), dict(type=int, default=12)),
            (("--pause",), dict(type=float, default=0.3)),
            (("--fault-host",), dict(type=int, default=-1)),
            (("--fault-step",), dict(type=int, default=-1)),
            (("--fault-wait",), dict(type=float, default=60.0)),
            (("--timeout",), dict(type=float, default=None)),
            (("--on-timeout",), dict(default=None)),
            (("--stall-rank",), dict(type=int, default=-1)),
            (("--stall-at",), dict(type=int, default=3)),
        ]
    )
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxsync
    import jaxsync.cluster

    mesh = local_mesh("d")
    shard = NamedSharding(mesh, P("d"))
    rng = np.random.default_rng(0)
    n = D * size
    x = rng.standard_normal((n, 8, 5)).astype(np.float32)
    y = rng.standard_normal((n, 8, 1)).astype(np.float32)
    lo = D * rank
    xs = jax.device_put(x[lo : lo + D], shard)
    ys = jax.device_put(y[lo : lo + D], shard)
    params = {
        "w1": (rng.standard_normal((5, 16)) / 3).astype(np.float32),
        "w2": (rng.standard_normal((16, 1)) / 4).astype(np.float32),
    }
    extra = {}
    if ns.timeout is not None:
        extra["timeout"] = ns.timeout
    if ns.on_timeout is not None:
        extra["on_timeout"] = ns.on_timeout
    tx = optax.chain(jaxsync.hierarchical_mean(axis_name="d", comm=comm, **extra), optax.sgd(0.1))

    def loss(p, xb, yb):
        return jnp.mean((jnp.tanh(xb @ p["w1"]) @ p["w2"] - yb) ** 2)

    def body(p, s, xb, yb):
        p, s = jax.tree.map(lambda a: a[0], (p, s))
        g = jax.grad(loss)(p, xb[0], yb[0])
        u, s = tx.update(g, s, p)
        p = optax.apply_updates(p, u)
        return jax.tree.map(lambda a: a[None], (p, s))

    def stack(tree):
        return jax.tree.map(lambda a: jax.device_put(jnp.stack([a] * D), shard), tree)

    rep, opt = stack(params), stack(tx.init(params))
    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")), donate_argnums=(0, 1)
    )
    rep, opt = jax.block_until_ready(step(rep, opt, xs, ys))  # compile and first step
    comm.Barrier()
    t0 = float(os.environ.get("JAXSYNC_CLUSTER_T0", time.time()))
    on_fault_host = os.environ.get("JAXSYNC_CLUSTER_HOST") == str(ns.fault_host)
    began = time.time() - t0
    longest = 0.0
    for i in range(ns.steps):
        jaxsync.cluster.mark(f"step-{i}")
        if on_fault_host and i == ns.fault_step:
            await_link_down(ns.fault_wait)
        if rank == ns.stall_rank and i == ns.stall_at:
            at = time.time() - t0
            print(f"rank {rank} stalls (in Python) before step {i} at t={at:.2f} s", flush=True)
            time.sleep(3600)
        t = time.perf_counter()
        rep, opt = jax.block_until_ready(step(rep, opt, xs, ys))
        longest = max(longest, time.perf_counter() - t)
        time.sleep(ns.pause)
    res.add("params", to_numpy(rep))
    res.add("began", began)
    res.add("ended", time.time() - t0)
    res.add("longest_step", longest)
    res.write()


def await_link_down(limit):
    """Wait until this host's link is down (its carrier, in the host's namespace)."""
    deadline = time.time() + limit
    while time.time() < deadline:
        with open("/sys/class/net/eth0/carrier") as f:
            if f.read().strip() == "0":
                return
        time.sleep(0.01)
    raise SystemExit(f"the link stayed up {limit:g} s after the fault's marker")


if __name__ == "__main__":
    main()

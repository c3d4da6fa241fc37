"""Agreement checks (rows 1-3, tests/_common.py): mismatched trees give the same error.

Rank 1 builds a tree that differs from rank 0's; every rank must raise the same
ValueError (recorded as ``(type, message)``) instead of hanging. The watchdog
(``--watchdog``, or armed before a step that may hang) turns a hang into
exit code 124.

Modes:
  basic   structure / shape / dtype mismatches for a jitted sync and for
          broadcast_params, then a matching sync that must still be exact.
  cached  both ranks first sync tree A; then rank 0 syncs A again in a fresh
          jit while rank 1 syncs a different tree B.
"""

from _worker import arm_watchdog, local_mesh, start


def main():
    ns, jax, comm, rank, size, D, res = start([(("--mode",), dict(default="basic"))])
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import jaxsync

    mesh = local_mesh("d")
    tx = jaxsync.hierarchical_mean(axis_name="d", comm=comm)

    def sync(tree):
        # A fresh jit each call: every call traces, so every call checks agreement.
        f = jax.jit(
            jax.shard_map(
                lambda t: tx.update(t, tx.init(t))[0], mesh=mesh, in_specs=P(), out_specs=P()
            )
        )
        return jax.block_until_ready(f(tree))

    def attempt(key, fn):
        try:
            out = fn()
            res.add(key, ("OK", jax.tree_util.tree_map(np.asarray, out)))
        except Exception as e:  # noqa: BLE001 - the type is part of the result
            res.add(key, (type(e).__name__, str(e)))

    f32, bf16 = jnp.float32, jnp.bfloat16
    mine = lambda a, b: a if rank == 0 else b  # noqa: E731

    if ns.mode == "basic":
        cases = {
            # (a) structure: rank 1 has an extra leaf ['layer'][2]
            "structure": (
                {"layer": [jnp.ones(2, f32), jnp.ones(2, f32)]},
                {"layer": [jnp.ones(2, f32), jnp.ones(2, f32), jnp.ones(2, f32)]},
            ),
            # (b) same size, different shape of leaf ['w']
            "shape": (
                {"b": jnp.ones(4, f32), "w": jnp.ones((2, 3), f32)},
                {"b": jnp.ones(4, f32), "w": jnp.ones((3, 2), f32)},
            ),
            # (c) dtype of leaf ['w']
            "dtype": (
                {"b": jnp.ones(4, f32), "w": jnp.ones((2, 3), f32)},
                {"b": jnp.ones(4, f32), "w": jnp.ones((2, 3), bf16)},
            ),
        }
        for name, (t0, t1) in cases.items():
            attempt(f"sync-{name}", lambda: sync(mine(t0, t1)))
        for name, (t0, t1) in cases.items():
            attempt(
                f"broadcast-{name}",
                lambda: jaxsync.broadcast_params(mine(t0, t1), root=1, comm=comm),
            )
        # Transform options differ (reduce): part of what the processes compare.
        tx_sum = jaxsync.hierarchical_mean(axis_name="d", comm=comm, reduce="sum")
        t = {"w": jnp.ones(3, f32)}

        def sync_with(txr):
            f = jax.jit(
                jax.shard_map(
                    lambda t: txr.update(t, txr.init(t))[0], mesh=mesh, in_specs=P(), out_specs=P()
                )
            )
            return jax.block_until_ready(f(t))

        attempt("sync-options", lambda: sync_with(mine(tx, tx_sum)))
        # The processes are still in step: a matching sync works and is exact.
        ok = {"w": jnp.full((D, 3), float(rank), f32)}
        f = jax.jit(
            jax.shard_map(
                lambda t: tx.update(t, tx.init(t))[0], mesh=mesh, in_specs=P("d"), out_specs=P("d")
            )
        )
        attempt("after-errors", lambda: jax.block_until_ready(f(ok)))
        res.write()
    elif ns.mode == "cached":
        a = {"w": jnp.ones(3, f32)}
        b = {"w": jnp.ones(4, f32)}
        attempt("first", lambda: sync(a))
        res.write()  # in case the next step hangs
        arm_watchdog(8)
        attempt("second", lambda: sync(mine(a, b)))
        res.write()
    else:
        raise SystemExit(f"unknown mode {ns.mode}")


if __name__ == "__main__":
    main()

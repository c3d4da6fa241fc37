"""Issue 10: tracing alone, comm="auto", custom nodes, NaN/f16, watchdog, exits.

Modes (``--mode``):
  trace_alone   comm="auto"; rank 0 alone calls jax.eval_shape, .lower() and
                jax.make_jaxpr of a synced step, then both ranks train (3
                steps). Before the fix the trace-time agreement blocked there.
  custom_node   a custom pytree node whose auxiliary data repr holds a memory
                address (a function, an object): sync and broadcast_params.
  nan_f16       check_finite=True with a NaN on rank 1 only; a float16 mean whose
                plain sum overflows (needs the default predivide).
  watchdog_loop 20 rounds: duplicate the world, 5 quick syncs with timeout= set,
                free_communicators, free the duplicate; then exit.
  host_exit     staging="host": dispatch chained syncs, exit without blocking.
  thread_level  MPI initialised with THREAD_SERIALIZED: staging="host" refuses.
"""

import sys

if "thread_level" in sys.argv:  # before mpi4py.MPI is imported by init()
    import mpi4py

    mpi4py.rc.thread_level = "serialized"

from _worker import Results, arm_watchdog, init  # noqa: E402


def main():
    ns, jax, MPI = init([(("--mode",), dict(required=True))])
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jaxsync

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    res = Results(ns.out, rank)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    D = jax.local_device_count()
    # replica r (across processes) holds r
    x = jnp.arange(D, dtype=jnp.float32) + D * rank

    def step_of(tx, make_tree):
        def body(r):
            t = make_tree(r[0])
            return tx.update(t, tx.init(t))[0]

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P()))

    if ns.mode == "trace_alone":
        tx = jaxsync.hierarchical_mean(axis_name="d")  # comm="auto"
        from jaxsync._core._config import make_config

        res.add("backend", repr(make_config("t", "hierarchical", "d", "auto").backend))
        step = step_of(tx, lambda v: {"w": jnp.full((5,), v)})
        res.write()
        arm_watchdog(40)  # a hang exits 124
        if rank == 0:  # fresh steps: each one is traced anew
            fresh = lambda: step_of(tx, lambda v: {"w": jnp.full((5,), v)})  # noqa: E731
            shapes = jax.eval_shape(fresh(), x)
            lowered = fresh().lower(x)
            jaxpr = jax.make_jaxpr(fresh())(x)
            res.add(
                "alone",
                (
                    str(shapes["w"].shape),
                    "jaxsync_allreduce" in lowered.as_text(),
                    len(str(jaxpr)) > 0,
                ),
            )
        outs = [np.asarray(jax.block_until_ready(step(x))["w"]) for _ in range(3)]
        res.add("train", outs)
        res.write()
    elif ns.mode == "custom_node":

        class Box:
            """A custom node whose aux data repr holds addresses."""

            def __init__(self, w, fn, tag):
                self.w, self.fn, self.tag = w, fn, tag

        jax.tree_util.register_pytree_with_keys(
            Box,
            lambda b: (((jax.tree_util.GetAttrKey("w"), b.w),), (b.fn, b.tag)),
            lambda aux, kids: Box(kids[0], *aux),
        )
        junk = [object() for _ in range(1000 * (rank + 1))]  # addresses differ
        fn = lambda v: v  # noqa: E731 - a distinct address on each process
        tag = object()
        del junk
        aux_repr = str(jax.tree_util.tree_structure(Box(1.0, fn, tag)))
        res.add("aux-repr", aux_repr)
        res.add("aux-reprs", comm.allgather(aux_repr))
        tx = jaxsync.flat_mean(axis_name="d", comm=comm)
        step = step_of(tx, lambda v: Box(jnp.full((3,), v), fn, tag))

        def attempt(key, f):
            try:
                res.add(key, ("OK", f()))
            except Exception as e:  # noqa: BLE001
                res.add(key, (type(e).__name__, str(e)))

        arm_watchdog(60)
        attempt("sync", lambda: np.asarray(jax.block_until_ready(step(x)).w))
        attempt(
            "broadcast",
            lambda: np.asarray(
                jaxsync.broadcast_params(
                    Box(jnp.full((3,), float(rank)), fn, tag), root=1, comm=comm
                ).w
            ),
        )
        res.write()
    elif ns.mode == "nan_f16":
        arm_watchdog(60)
        tx = jaxsync.hierarchical_mean(axis_name="d", comm=comm, check_finite=True)

        def body(r):
            bad = jnp.where((r[0] == 2 * D - 1), jnp.nan, 1.0)  # last replica of rank 1
            t = {"w": jnp.full((4,), bad), "v": jnp.full((3,), r[0])}
            out, state = tx.update(t, tx.init(t))
            return out, state.all_finite

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P()))
        out, finite = f(x)
        res.add("nan", (np.asarray(out["w"]), np.asarray(out["v"]), bool(finite)))
        for staging in ("device", "host"):
            t16 = jaxsync.hierarchical_mean(axis_name="d", comm=comm, staging=staging)
            big = step_of(
                t16, lambda v: {"h": jnp.full((6,), 40000.0, jnp.float16) + v.astype(jnp.float16)}
            )
            res.add(f"f16-{staging}", np.asarray(jax.block_until_ready(big(x))["h"]))
        res.write()
    elif ns.mode == "watchdog_loop":
        arm_watchdog(100)
        rounds = []
        for _ in range(20):
            sub = comm.Dup()
            tx = jaxsync.two_dimensional_mean(axis_name="d", comm=sub, timeout=0.05)
            step = step_of(tx, lambda v: {"w": jnp.full((7,), v)})
            for _ in range(5):
                out = step(x)
            out = np.asarray(jax.block_until_ready(out)["w"])
            from jaxsync._comm._topology import Comms

            mine = Comms.of(sub)
            handles = [
                mine.world,
                mine.control,
                mine.agreement,
                *mine._devices,
                *[w.comm for w in mine._watchdogs.values()],
            ]
            freed = jaxsync.free_communicators(sub)
            sub.Free()
            rounds.append((out, freed, len(handles), all(h == MPI.COMM_NULL for h in handles)))
        res.add("rounds", rounds)
        res.write()
        # falls off the end: clean exit with watchdog threads stopped
    elif ns.mode == "host_exit":
        tx = jaxsync.hierarchical_mean(axis_name="d", comm=comm, staging="host")
        step = step_of(tx, lambda v: {"w": jnp.full((D,), v)})
        y = x
        for _ in range(5):
            y = step(y)["w"]  # chained; never blocked on
        res.add("dispatched", True)
        res.write()
    elif ns.mode == "thread_level":
        try:
            jaxsync.hierarchical_mean(axis_name="d", comm=comm, staging="host")
            res.add("host", ("OK", MPI.Query_thread()))
        except Exception as e:  # noqa: BLE001
            res.add("host", (type(e).__name__, str(e)))
        res.write()
    else:
        raise SystemExit(f"unknown mode {ns.mode}")


if __name__ == "__main__":
    main()

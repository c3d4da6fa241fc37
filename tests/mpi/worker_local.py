"""jaxsync.local across processes: islands="process" (one island per process).

Device r = D * rank + d holds the quadratic 1/2 |x - C[r]|^2 (gradient x - C[r]);
each island's inner mean averages its D devices. Every case runs as a jitted
step called once per step (the state crosses separate calls), under shard_map
over the D devices ("smap") and, on one device with axis_name=None, plain jit
("jit"). Results: per-step parameters and anchors, which test_local_mpi.py
compares with float64 references written out (bitwise: dyadic values); the
guard's error; the skip of a non-finite island; a disagreement on ``every``
(the same error on every rank, no hang).
"""

import os

from _worker import Results, init, to_numpy

C = [[3.0, -5.0], [1.0, 7.0], [-2.0, 4.0], [6.0, 0.0]]
X0 = [4.0, -2.0]


def main():
    ns, jax, MPI = init()
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jaxsync

    comm = MPI.COMM_WORLD
    rank, size, dev = comm.Get_rank(), comm.Get_size(), ns.devices
    res = Results(ns.out, rank)
    res.add("meta", {"size": size, "devices": dev})
    mesh = Mesh(np.array(jax.local_devices()), ("d",))
    c_all = np.asarray(C, np.float32)

    def run(make, mode, steps, bad=None, split=False, kind="process", off=0.0):
        axis = "d" if mode == "smap" else None
        isl = jaxsync.islands(kind, axis_name=axis, comm=comm)
        tx = make(isl)
        p = {"x": jnp.asarray(X0, jnp.float32) + jnp.float32(off)}
        if mode == "smap":
            c = jnp.asarray(c_all[rank * dev : (rank + 1) * dev])

            def step(c, s, p, nan):
                g = {"x": p["x"] - c[0] + nan}
                u, s = tx.update(g, s, p)
                return optax.apply_updates(p, u), s

            s = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P()))(p)
            f = jax.jit(
                jax.shard_map(
                    step, mesh=mesh, in_specs=(P("d"), P(), P(), P()), out_specs=(P(), P())
                )
            )
        else:  # one island of one device: the process's first device's target
            c = jnp.asarray(c_all[rank * dev])
            if split:  # two leaves (streaming's fragments)
                p = {"x": p["x"][:1], "y": p["x"][1:]}

            def step(c, s, p, nan):
                cs = {"x": c[:1], "y": c[1:]} if split else {"x": c}
                g = jax.tree.map(lambda x, cc: x - cc + nan, p, cs)
                u, s = tx.update(g, s, p)
                return optax.apply_updates(p, u), s

            s, f = tx.init(p), jax.jit(step)
        both = (lambda t: jnp.concatenate([t["x"], t["y"]])) if split else (lambda t: t["x"])
        out = []
        for t in range(steps):
            nan = jnp.float32(np.nan if bad == (t, rank) else 0.0)
            p, s = f(c, s, p, nan)
            out.append((to_numpy(both(p)), to_numpy(both(s.anchor)), int(s.skipped)))
        return out

    def inner(isl, lr):
        return optax.chain(
            jaxsync.hierarchical_mean(axis_name=isl.axis_name, comm=isl.comm), optax.sgd(lr)
        )

    for mode in ("smap", "jit"):
        res.add(
            f"{mode}:dp",
            run(lambda isl: jaxsync.diloco(inner(isl, 0.5), optax.sgd(1.0), every=1, islands=isl),
                mode, 3),
        )  # fmt: skip
        res.add(
            f"{mode}:diloco",
            run(
                lambda isl: jaxsync.diloco(
                    inner(isl, 0.5), optax.sgd(0.5, momentum=0.5), every=2, islands=isl
                ),
                mode,
                6,
            ),
        )
        res.add(
            f"{mode}:bmuf",
            run(lambda isl: jaxsync.bmuf(inner(isl, 0.5), every=2, islands=isl), mode, 6),
        )
    # streaming, its mean in flight across jitted calls or held; float32 and a
    # bfloat16 wire (two processes: each element summed in float32, rounded once)
    # (the GPU path, JAXSYNC_TESTING_MPI4JAX=1: overlap=True refused, the error kept)
    gpu_path = os.environ.get("JAXSYNC_TESTING_MPI4JAX") == "1"
    for ov, dt in ((False, None), (True, None), (False, jnp.bfloat16), (True, jnp.bfloat16)):
        key = f"stream:{ov}" + (":bf16" if dt else "")
        if ov and gpu_path:
            try:
                jaxsync.diloco(
                    optax.sgd(0.5), every=4, fragments=2, delay=1, overlap=True,
                    islands=jaxsync.islands("process", comm=comm),
                )  # fmt: skip
                res.add(key, ("OK", None))
            except ValueError as e:
                res.add(key, ("ValueError", str(e)))
            continue
        res.add(
            key,
            run(
                lambda isl, ov=ov, dt=dt: jaxsync.diloco(
                    inner(isl, 0.5),
                    optax.sgd(0.5, momentum=0.5),
                    every=4,
                    fragments=2,
                    delay=1,
                    mix=0.5,
                    islands=isl,
                    overlap=ov,
                    comm_dtype=dt,
                ),
                "jit",
                9,
                split=True,
            ),
        )
    res.add(
        "warmup",
        run(lambda isl: jaxsync.local_sgd(inner(isl, 0.5), 2, warmup=2, islands=isl), "smap", 6),
    )
    res.add(
        "bf16",
        run(
            lambda isl: jaxsync.diloco(
                inner(isl, 0.5), every=2, islands=isl, comm_dtype=jnp.bfloat16
            ),
            "smap",
            4,
        ),
    )
    # timeout=: every stage the step enters (the configuration's agreement too)
    # is left once the step's outputs exist (none open: never a stall reported)
    res.add(
        "watched",
        run(
            lambda isl: jaxsync.diloco(
                inner(isl, 0.5), optax.sgd(0.5, momentum=0.5), every=2, islands=isl, timeout=600.0
            ),
            "smap",
            3,
        ),
    )
    from jaxsync._comm._topology import Comms

    res.add(
        "watched:open",
        [sorted(w._open) for c in Comms._cache.values() for w in c._watchdogs.values()],
    )
    res.add(
        "skip",
        run(lambda isl: jaxsync.diloco(inner(isl, 0.5), every=2, islands=isl), "smap", 4, (3, 1)),
    )
    # a NaN gradient at inner step 1 of 4 on rank 1: back to the anchor at step 3
    res.add(
        "nan-inner",
        run(lambda isl: jaxsync.diloco(inner(isl, 0.5), every=4, islands=isl), "jit", 6, (1, 1)),
    )

    # islands="host": both processes share this machine: one island of two, whose
    # inner mean may span the world (it is the island); the outer mean has no peer.
    host = jaxsync.islands("host", comm=comm)
    res.add("host:islands", (host.count, host.comm.Get_size(), host.outer_comm is None))

    def world_island(isl):
        tx = optax.chain(jaxsync.hierarchical_mean(axis_name=None, comm=comm), optax.sgd(0.5))
        return jaxsync.diloco(tx, optax.sgd(0.5), every=2, islands=isl)

    res.add("host", run(world_island, "jit", 4, kind="host"))

    def attempt(key, fn):
        try:
            res.add(key, ("OK", fn()))
        except Exception as e:  # noqa: BLE001 - the type is part of the result
            res.add(key, (type(e).__name__, str(e)))

    # An inner mean over the whole world: refused when traced, on every rank.
    def world_inner(isl):
        tx = optax.chain(jaxsync.hierarchical_mean(axis_name=None, comm=comm), optax.sgd(0.5))
        return jaxsync.diloco(tx, every=2, islands=isl)

    attempt("guard", lambda: run(world_inner, "jit", 1))
    # Islands that disagree on every: the same error on every rank at the first step.
    attempt(
        "disagree",
        lambda: run(
            lambda isl: jaxsync.diloco(inner(isl, 0.5), every=2 + 2 * rank, islands=isl), "jit", 2
        ),
    )
    # Rank 1 starts elsewhere: the first outer step after the warm-up fails on both.
    attempt(
        "anchors",
        lambda: run(
            lambda isl: jaxsync.local_sgd(inner(isl, 0.5), 2, warmup=1, islands=isl),
            "jit",
            3,
            off=float(rank),
        ),
    )
    res.write()


if __name__ == "__main__":
    main()

"""Sharded checkpoints across world sizes under ``mpirun -n 2`` (2 devices each).

World A is both ranks (4 replicas), world B rank 0 alone (``comm=None``, 2
replicas). ``jaxsync.sharded`` and the chain (``reduce="sum"``, integer
gradients, power-of-two hyperparameters: bit for bit) train 3 steps in one
world; every rank saves its own part with orbax into ``DIR/<world>/rank{R}``
(orbax sees process 0 on every rank: each rank owns its directory), rank 0
writes ``world.json``, a barrier; then the other world restores each of its
ranks' parts with ``jaxsync.reshard_state`` (orbax restores of the saved
parts into ``jaxsync.state_shapes``), which must equal the chain's state cut
for it, and takes one more step, which must equal the chain's. A to B, and B
to A. And ``gather_state(..., comm=...)`` puts the whole state on rank 0 only.
"""

import json
from pathlib import Path

from _worker import Results, init, to_numpy

STEPS = 3


def main():
    ns, jax, MPI = init([(("--ckpt",), {"required": True})])
    import jax.numpy as jnp
    import numpy as np
    import optax
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxsync

    comm = MPI.COMM_WORLD
    rank, size, dev = comm.Get_rank(), comm.Get_size(), ns.devices
    res = Results(ns.out, rank)
    root = Path(ns.ckpt)
    params = {
        "b": jnp.zeros(()),
        "c": jnp.arange(7.0),
        "w": jnp.ones((3, 5)),
        "k": jnp.full((2, 3, 4), 2.0),
    }
    inner = lambda: optax.adam(0.125, b1=0.5, b2=0.5)  # noqa: E731
    mesh = Mesh(np.array(jax.local_devices()), ("d",))
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def grads(t, first):
        """Replicas first .. first + dev - 1 at step t, stacked (integers)."""
        out = {}
        for j, (name, p) in enumerate(sorted(params.items())):
            m = int(np.prod(p.shape))
            r = (first + np.arange(dev, dtype=np.float32))[:, None]
            v = ((r * 3 + np.arange(m) + 5 * t + j) % 11) - 5
            shape = (dev * p.shape[0], *p.shape[1:]) if p.ndim else (dev,)
            out[name] = jnp.asarray(v.reshape(shape))
        return out

    def run(tx, first, steps, t0=0, state=None, p=params):
        specs = jaxsync.state_specs(jax.eval_shape(tx.init, params), "d")

        def step(g, st, p):
            u, st = tx.update(jax.tree.map(lambda x, q: x.reshape(q.shape), g, p), st, p)
            return optax.apply_updates(p, u), st

        f = jax.jit(
            jax.shard_map(step, mesh=mesh, in_specs=(P("d"), specs, P()), out_specs=(P(), specs))
        )
        if state is None:
            init_fn = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)
            state = jax.jit(init_fn)(params)
        else:
            put = lambda s: NamedSharding(mesh, s)  # noqa: E731
            state = jax.device_put(state, jax.tree.map(put, specs))
        for t in range(t0, t0 + steps):
            p, state = f(grads(t, first), state, p)
        return p, state

    def txs(world_comm):
        kw = dict(axis_name="d", comm=world_comm, reduce="sum")
        return jaxsync.sharded(inner(), **kw), optax.chain(jaxsync.hierarchical_mean(**kw), inner())

    def save(world, state, replicas, processes):
        with ocp.StandardCheckpointer() as c:  # this rank's part, its own directory
            c.save(root / world / f"rank{rank}", state.inner)
        if rank == 0:
            meta = {"replicas": replicas, "processes": processes}
            (root / world / "world.json").write_text(json.dumps(meta))

    def restore(world, replicas, process, processes):
        meta = json.loads((root / world / "world.json").read_text())
        loaded = []

        def load(q):
            loaded.append(q)
            shapes = jaxsync.state_shapes(
                inner(), params, replicas=meta["replicas"], process=q,
                processes=meta["processes"],
            )  # fmt: skip
            target = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), shapes.inner
            )
            with ocp.StandardCheckpointer() as c:
                return c.restore(root / world / f"rank{q}", target)

        state = jaxsync.reshard_state(
            inner(), params, load, saved_replicas=meta["replicas"],
            saved_processes=meta["processes"], replicas=replicas, process=process,
            processes=processes,
        )  # fmt: skip
        return state, loaded

    def same(a, b):
        la, lb = jax.tree.leaves(to_numpy(a)), jax.tree.leaves(to_numpy(b))
        return len(la) == len(lb) and all(
            x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in zip(la, lb)
        )

    # A (2 ranks x 2 devices) -> B (rank 0 alone, 2 devices)
    sharded_a, chain_a = txs("auto")
    _, s_a = run(sharded_a, rank * dev, STEPS)
    cp_a, cs_a = run(chain_a, rank * dev, STEPS)
    save("a", s_a, size * dev, size)
    whole = jaxsync.gather_state(inner(), s_a, params, comm=comm)  # rank 0 only
    res.add("whole_on_root", None if whole is None else same(whole, jax.device_get(cs_a[1])))
    comm.Barrier()  # every part written
    if rank == 0:
        sharded_b, chain_b = txs(None)
        got, loaded = restore("a", dev, 0, 1)
        want = jaxsync.shard_state(inner(), jax.device_get(cs_a[1]), params, replicas=dev)
        res.add("a_to_b", {"state": same(got, want), "loaded": loaded})
        p1, _ = run(sharded_b, 0, 1, STEPS, got, jax.device_get(cp_a))
        p2, _ = run(chain_b, 0, 1, STEPS, jax.device_get(cs_a), jax.device_get(cp_a))
        res.add("a_to_b_step", (same(p1, p2), same(p1, cp_a)))
        # B -> A: rank 0 alone trains and saves
        _, s_b = run(sharded_b, 0, STEPS)
        save("b", s_b, dev, 1)
    comm.Barrier()
    # every rank: the chain in world B (one process, comm=None), the reference
    cp_b, cs_b = run(txs(None)[1], 0, STEPS)
    got, loaded = restore("b", size * dev, rank, size)
    want = jaxsync.shard_state(
        inner(), jax.device_get(cs_b[1]), params, replicas=size * dev, process=rank, processes=size
    )
    res.add("b_to_a", {"state": same(got, want), "loaded": loaded})
    p1, _ = run(sharded_a, rank * dev, 1, STEPS, got, jax.device_get(cp_b))
    p2, _ = run(chain_a, rank * dev, 1, STEPS, jax.device_get(cs_b), jax.device_get(cp_b))
    res.add("b_to_a_step", (same(p1, p2), same(p1, cp_b)))
    res.add("dirs", sorted(p.name for p in (root / "a").iterdir()))
    res.write()


if __name__ == "__main__":
    main()

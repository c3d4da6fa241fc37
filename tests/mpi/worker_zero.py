"""jaxsync.sharded across processes, against optax.chain(hierarchical_mean, inner).

Replica ``r = D * rank + d`` has, at step ``t``, integer gradients (a closed
form of r, t and the element's index, in [-5, 5]). Each inner optimizer runs
STEPS steps as ``jaxsync.sharded(inner)`` and as the chain, under
``shard_map`` over the D local devices (and, with D == 1, plain ``jit`` with
``axis_name=None``), ``reduce="sum"`` with power-of-two hyperparameters (every
product exact: equal bit for bit), and ``optax.adam``'s defaults with the
mean (a tolerance: the chain's allreduce and sharded's reduce-scatter may sum
in different orders). The states of every rank are gathered (``gather_state``)
and compared with the chain's, and cut again (``shard_state``) into this
rank's own.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # _zero_ref

from _worker import Results, init, to_numpy  # noqa: E402

STEPS = 20


def main():
    ns, jax, MPI = init([(("--cases",), dict(default="all"))])
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jaxsync

    comm = MPI.COMM_WORLD
    rank, size, dev = comm.Get_rank(), comm.Get_size(), ns.devices
    n = size * dev
    res = Results(ns.out, rank)
    res.add("meta", {"size": size, "devices": dev})
    from _zero_ref import PARAMS as params
    from _zero_ref import WD_MASK as mask
    from _zero_ref import replica_grads

    def grads(t):
        """This process's replicas' gradients: (dev, ...) per leaf."""
        mine = rank * dev + np.arange(dev)
        return {k: jnp.asarray(v) for k, v in replica_grads(mine, t).items()}

    inners = {
        "sgd": lambda: optax.sgd(0.125),
        "momentum": lambda: optax.sgd(0.125, momentum=0.5, nesterov=True),
        "adamw": lambda: optax.adamw(0.125, b1=0.5, b2=0.5, weight_decay=0.25, mask=mask),
        "lion": lambda: optax.lion(0.125, b1=0.5, b2=0.5),
        "clip": lambda: optax.chain(jaxsync.clip_by_global_norm(64.0), optax.sgd(0.125)),
    }
    cases = list(inners) if ns.cases == "all" else ns.cases.split(",")
    mesh = Mesh(np.array(jax.local_devices()), ("d",))

    def run(tx, jit_only):
        if jit_only:  # one device per process, no map

            def step(g, st, p):
                g = jax.tree.map(lambda x: x[0], g)
                u, st = tx.update(g, st, p)
                return optax.apply_updates(p, u), st

            state, f = jax.jit(tx.init)(params), jax.jit(step)
        else:
            specs = jaxsync.state_specs(jax.eval_shape(tx.init, params), "d")

            def step(g, st, p):
                g = jax.tree.map(lambda x, q: x.reshape(q.shape), g, p)
                u, st = tx.update(g, st, p)
                return optax.apply_updates(p, u), st

            state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(
                params
            )
            f = jax.jit(
                jax.shard_map(
                    step, mesh=mesh, in_specs=(P("d"), specs, P()), out_specs=(P(), specs)
                )
            )
        p = params
        for t in range(STEPS):
            g = grads(t)
            if not jit_only:
                g = jax.tree.map(
                    lambda x: x.reshape((dev * x.shape[1],) + x.shape[2:]) if x.ndim > 1 else x, g
                )
            p, state = f(g, state, p)
        return to_numpy(p), state

    modes = [False] + ([True] if dev == 1 else [])
    with jax.numpy_dtype_promotion("standard"):
        for jit_only in modes:
            axis = None if jit_only else "d"
            tag = "jit" if jit_only else "shard_map"
            for name in cases:
                inner = inners[name]
                got, state = run(jaxsync.sharded(inner(), axis_name=axis, reduce="sum"), jit_only)
                want, cstate = run(
                    optax.chain(jaxsync.hierarchical_mean(axis_name=axis, reduce="sum"), inner()),
                    jit_only,
                )
                res.add(f"{tag}:{name}", (got, want))
                local = jax.device_get(state)
                every = comm.allgather(local)
                whole = jaxsync.gather_state(inner(), every, params)
                res.add(
                    f"{tag}:{name}:state",
                    (to_numpy(whole), to_numpy(jax.device_get(cstate[1]))),
                )
                mine = jaxsync.shard_state(
                    inner(), whole, params, replicas=n, process=rank, processes=size
                )
                res.add(f"{tag}:{name}:reshard", (to_numpy(mine.inner), to_numpy(local.inner)))
            # optax's defaults and the mean: within a tolerance of the chain
            got, _ = run(jaxsync.sharded(optax.adam(1e-2), axis_name=axis), jit_only)
            want, _ = run(
                optax.chain(jaxsync.hierarchical_mean(axis_name=axis), optax.adam(1e-2)), jit_only
            )
            res.add(f"{tag}:adam_mean", (got, want))
        res.add("calls", calls_per_step(jax, jaxsync, optax, mesh, P, dev))
        if dev == 1:  # the donated step copies nothing (no state copied in or out)
            tx = jaxsync.sharded(optax.adam(1e-2), axis_name=None)

            def donated(p, st, g):
                u, st = tx.update(g, st, p)
                return optax.apply_updates(p, u), st

            st = jax.jit(tx.init)(params)
            hlo = jax.jit(donated, donate_argnums=(0, 1)).lower(params, st, params).compile()
            entry = hlo.as_text().split("ENTRY", 1)[1]
            res.add("copies", entry.count(" copy("))
            # nor packs: each leaf reduce-scattered in place, its slice gathered as it is
            rs = [ln for ln in entry.splitlines() if "jaxsync_reduce_scatter" in ln]
            res.add("rs_in_place", [("output_to_operand_aliasing" in ln) for ln in rs])
            res.add("concatenates", entry.count(" concatenate("))
            # host staging (mpi4py through the host; GPUs without CUDA-aware MPI)
            for dt in (None, jnp.bfloat16):
                opts = dict(axis_name=None, staging="host", reduce="sum", comm_dtype=dt)
                got, _ = run(jaxsync.sharded(inners["momentum"](), **opts), True)
                chain = jaxsync.hierarchical_mean(**opts)
                want, _ = run(optax.chain(chain, inners["momentum"]()), True)
                res.add(f"host:{'bf16' if dt else 'f32'}", (got, want))
    res.write()


def calls_per_step(jax, jaxsync, optax, mesh, P, dev):
    """Native calls a step, from the timeline (kind -> count, per step), of
    sharded(adam) and the chain on a transformer-like tree of 26 small leaves."""
    import json
    import tempfile

    import jax.numpy as jnp

    from jaxsync.bench.trees import transformer_like

    params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), transformer_like(2, 16, 32))
    out = {}
    for name, tx in {
        "sharded": jaxsync.sharded(optax.adam(0.125), axis_name="d"),
        "chain": optax.chain(jaxsync.hierarchical_mean(axis_name="d"), optax.adam(0.125)),
    }.items():
        specs = jaxsync.state_specs(jax.eval_shape(tx.init, params), "d")
        st = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

        def step(p, s, tx=tx):
            g = jax.tree.map(lambda x: x * 0.5, p)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs), out_specs=(P(), specs)))
        p = params
        p, st = jax.block_until_ready(f(p, st))  # compiled, agreed
        with jaxsync.timeline(tempfile.mkdtemp()) as tl:
            for i in range(3):
                with tl.step(i):
                    p, st = jax.block_until_ready(f(p, st))
        events = json.loads(tl.path.read_text())["traceEvents"]
        kinds: dict = {}
        for e in events:
            if e.get("cat") == "communication":
                kinds[e["name"]] = kinds.get(e["name"], 0) + 1
        out[name] = {k: v / 3 for k, v in kinds.items()}
    out["leaves"] = len(jax.tree.leaves(params))
    return out


if __name__ == "__main__":
    main()

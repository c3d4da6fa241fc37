"""Benchmark of the sharded optimizer state: ``python -m jaxsync bench --suite sharded``.

``jaxsync.sharded(inner)`` against ``optax.chain(jaxsync.hierarchical_mean(), inner)``
in docs/sharded.md's train step (``jit(shard_map(step))``, ``state_specs``, params
and state donated; loss ``sum(x p^2 / 2)``, ``x`` each replica's own), for ``adam``
on the ResNet-like tree and ``clip+adamw`` (``jaxsync.clip_by_global_norm``,
``adamw`` with a decay mask) on a deep tree of 256 medium leaves, where the
optimizer costs. Per case: **memory**, the optimizer state's bytes per device
measured from the arrays (``addressable_shards[0].data.nbytes`` summed), their
ratio beside ``sum ceil(n/N) / sum n`` and the bytes the inner state of the slices
must have, and the step's ``memory_analysis()``; **time**, ms per step of both and
their ratio (issue 33: <= 1.05 in shared memory), beside the bare collectives of the
gradient's bytes (an allreduce; a reduce-scatter and an all-gather: XLA's in one
process, mpi4py's under mpirun) and ``inner.update`` alone on one device on the
whole tree and on one replica's slices (the optimizer's compute: about 1/N); and
the HLO op counts of both steps. Interleaved rounds, each sample the median of
``--iters`` calls, the slowest rank's; the CPU-busy share beside each figure. One
process with ``--devices`` fake CPU devices (``intra``, default 4) or ``mpirun -n P``,
one device each (``shm``, ``cluster``): ``sharded-<mode>.json`` / ``.png`` in ``--out``.

What it may import: numpy, jax, optax, mpi4py, ``jaxsync`` (public API) and the
other ``jaxsync.bench`` modules.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

from .report import save_plot
from .timing import CpuMeter, ranks_share, time_calls

AXIS = "data"
CASES = {"resnet18": "adam", "deep": "clip+adamw"}
"""The default cases: tree -> inner optimizer."""
QUICK_CASES = {"tiny": "adam", "tiny_deep": "clip+adamw"}
HLO_OPS = ("copy", "fusion", "all-reduce", "reduce-scatter", "all-gather", "custom-call")


def make_tree(name: str) -> dict:
    """The case's parameter shapes (``jax.ShapeDtypeStruct`` leaves)."""
    from .trees import _spec, resnet18_like

    if name == "resnet18":
        return resnet18_like()
    layers, width = {"deep": (128, 256), "tiny": (3, 24), "tiny_deep": (6, 16)}[name]
    return {
        f"l{i:03d}": {"w": _spec((width // 2, width)), "b": _spec((width,))} for i in range(layers)
    }


def make_inner(name: str, params):
    """``adam``, or ``jaxsync.clip_by_global_norm`` + ``adamw`` (kernels decayed)."""
    import jax
    import optax

    import jaxsync

    if name == "adam":
        return optax.adam(1e-3)
    decay = jax.tree.map(lambda x: len(x.shape) > 1, params)
    return optax.chain(
        jaxsync.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=1e-4, mask=decay)
    )


def loss_fn(p, x):
    import jax

    return sum(0.5 * x[0] * (a * a).sum() for a in jax.tree.leaves(p))


def nbytes_per_device(tree) -> int:
    """Bytes of a tree's arrays on one device (each leaf's first local shard)."""
    import jax

    return sum(int(x.addressable_shards[0].data.nbytes) for x in jax.tree.leaves(tree))


def _struct_bytes(tree) -> int:
    import jax
    import numpy as np

    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def slice_struct(a, replicas: int):
    """One replica's slice of leaf ``a``: ``ceil(n / N)`` elements, the leaf's rank kept."""
    import jax

    k = -(-math.prod(a.shape) // replicas)
    return jax.ShapeDtypeStruct((1,) * max(len(a.shape) - 1, 0) + (k,), a.dtype)


def hlo_ops(text: str) -> dict[str, int]:
    """Each of ``HLO_OPS`` counted in a compiled module's entry computation."""
    entry = text.split("\nENTRY", 1)[-1].split("\n}", 1)[0]  # async pairs: once (-start)
    return {op: len(re.findall(rf"\s{re.escape(op)}(?:-start)?\(", entry)) for op in HLO_OPS}


class Step:
    """One train step of ``tx`` (the docs' pattern), compiled, with its carry."""

    def __init__(self, tx, mesh, params, x):
        import jax
        import jax.numpy as jnp
        import optax
        from jax.sharding import PartitionSpec as P

        import jaxsync

        specs = jaxsync.state_specs(jax.eval_shape(tx.init, params), AXIS)
        init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))

        def step(p, s, x):
            loss, g = jax.value_and_grad(loss_fn)(p, x)
            loss = jaxsync.replica_mean(loss, axis_name=AXIS)  # before: no copies (sharp-bits)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s, loss

        train = jax.jit(
            jax.shard_map(
                step, mesh=mesh, in_specs=(P(), specs, P(AXIS)), out_specs=(P(), specs, P())
            ),
            donate_argnums=(0, 1),
        )
        s = init(p := jax.tree.map(jnp.copy, params))
        self.state_bytes = nbytes_per_device(s)
        t0 = time.perf_counter()
        compiled = train.lower(p, s, x).compile()
        self.ops, self.compile_s = hlo_ops(compiled.as_text()), time.perf_counter() - t0
        self.memory = _memory(compiled)
        self.run, self.carry, self.x = compiled, (p, s), x

    def __call__(self):
        p, s, loss = self.run(*self.carry, self.x)
        self.carry = (p, s)
        return p, s, loss


def _memory(compiled) -> dict:
    keys = ("temp", "argument", "output", "alias", "generated_code")
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend reports it
        m = None
    return {k: getattr(m, f"{k}_size_in_bytes", None) for k in keys}


def _bare(comm, mesh, nbytes: int) -> dict:
    """The bare collectives of ``nbytes`` per replica: one allreduce, and a
    reduce-scatter then an all-gather (float32, preallocated)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    size = mesh.size if comm is None else comm.Get_size()
    n = -(-max(1, nbytes // 4) // size) * size
    if comm is not None:
        from mpi4py import MPI

        x, out = np.ones(n, np.float32), np.empty(n, np.float32)
        part = np.empty(n // size, np.float32)

        def rs():
            comm.Reduce_scatter_block(x, part, op=MPI.SUM)
            comm.Allgather(part, out)

        return {"bare allreduce": lambda: comm.Allreduce(x, out, op=MPI.SUM), "bare rs+ag": rs}

    def jitted(body):
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
        buf = jnp.ones((size * n,), jnp.float32)
        return lambda: f(buf)

    def rs_ag(g):
        return jax.lax.all_gather(jax.lax.psum_scatter(g, AXIS, tiled=True), AXIS, tiled=True)

    return {"bare allreduce": jitted(lambda g: jax.lax.psum(g, AXIS)), "bare rs+ag": jitted(rs_ag)}


def _update_fns(inner, params, replicas: int) -> dict:
    """``inner.update`` alone on one device: the whole tree and one replica's slices."""
    import jax
    import jax.numpy as jnp

    def one(tree):
        g = jax.tree.map(lambda a: jnp.full(a.shape, 1e-3, a.dtype), tree)
        p = jax.tree.map(lambda a: jnp.full(a.shape, 0.5, a.dtype), tree)
        s, f = inner.init(p), jax.jit(inner.update)
        return lambda: f(g, s, p)

    sliced = jax.tree.map(lambda a: slice_struct(a, replicas), params)
    return {"update whole": one(params), "update slice": one(sliced)}


def measure(tree_name: str, opt: str, comm, rounds: int, iters: int) -> dict:
    """One case's row: memory, times (median over interleaved rounds), ops."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh

    import jaxsync

    if comm is not None:
        from mpi4py import MPI
    shapes = make_tree(tree_name)
    mesh = Mesh(np.array(jax.local_devices()), (AXIS,))
    rank, procs = (0, 1) if comm is None else (comm.Get_rank(), comm.Get_size())
    replicas = mesh.size * procs
    params = jax.tree.map(lambda s: jnp.full(s.shape, 0.5, s.dtype), shapes)
    x = jnp.arange(mesh.size, dtype=jnp.float32) + 1.0 + rank * mesh.size
    inner = make_inner(opt, shapes)
    c = None if comm is None else "auto"
    txs = {
        "chain": optax.chain(jaxsync.hierarchical_mean(axis_name=AXIS, comm=c), inner),
        "sharded": jaxsync.sharded(inner, axis_name=AXIS, comm=c),
    }
    steps = {k: Step(tx, mesh, params, x) for k, tx in txs.items()}
    gbytes = _struct_bytes(shapes)
    fns = {**steps, **_bare(comm, mesh, gbytes), **_update_fns(inner, shapes, replicas)}
    for fn in fns.values():  # warm up
        for _ in range(2):
            jax.block_until_ready(fn())
    samples: dict = {k: [] for k in fns}
    meters = {k: CpuMeter() for k in fns}
    barrier = None if comm is None else comm.Barrier
    for _ in range(rounds):
        for k, fn in fns.items():
            t = time_calls(fn, iters, barrier, meters[k])[0]
            samples[k].append(t if comm is None else comm.allreduce(t, op=MPI.MAX))
    machine, ranks = ranks_share(list(meters.values()), comm)
    med = {k: statistics.median(v) for k, v in samples.items()}
    sizes = [math.prod(s.shape) for s in jax.tree.leaves(shapes)]
    layout_ratio = sum(-(-n // replicas) for n in sizes) / sum(sizes)
    sliced = jax.tree.map(lambda a: slice_struct(a, replicas), shapes)
    chain_b, sharded_b = steps["chain"].state_bytes, steps["sharded"].state_bytes
    return {
        "tree": tree_name,
        "optimizer": opt,
        "leaves": len(sizes),
        "params": sum(sizes),
        "gradient_bytes": gbytes,
        "replicas": replicas,
        "state_bytes": {"chain": chain_b, "sharded": sharded_b},
        "state_ratio": sharded_b / chain_b,
        "layout_ratio": layout_ratio,
        "expected_bytes": {
            "chain": _struct_bytes(jax.eval_shape(inner.init, shapes)),
            "sharded": _struct_bytes(jax.eval_shape(inner.init, sliced)),
        },
        "step_memory": {k: s.memory for k, s in steps.items()},
        "hlo_ops": {k: s.ops for k, s in steps.items()},
        "compile_s": {k: round(s.compile_s, 2) for k, s in steps.items()},
        "median_ms": {k: v * 1e3 for k, v in med.items()},
        "samples_ms": {k: [t * 1e3 for t in v] for k, v in samples.items()},
        "step_ratio": med["sharded"] / med["chain"],
        "update_ratio": med["update slice"] / med["update whole"],
        "cpu_busy": {k: {"machine": m, "ranks": r} for k, m, r in zip(fns, machine, ranks)},
    }


def targets(rows: list[dict], shared_memory: bool) -> list[dict]:
    """Issue 33's: sharded's state bytes per device at most the layout's share of
    the chain's (plus 1% and 64 bytes for the scalars), and (shared memory) its
    step at most 1.05x the chain's."""
    out = []
    for r in rows:
        tag = f"{r['tree']} {r['optimizer']}"
        limit = r["layout_ratio"] * 1.01 + 64 / r["state_bytes"]["chain"]
        out.append((f"{tag}: state bytes sharded / chain", r["state_ratio"], limit))
        if shared_memory:
            out.append((f"{tag}: step sharded / chain", r["step_ratio"], 1.05))
    return [{"what": w, "value": v, "limit": lim, "ok": v <= lim} for w, v, lim in out]


def plot(rows: list[dict], meta: dict, path: Path) -> None:
    """Per case: ms per call of every timed thing, and the state's MB per device."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 1]})
    labels = [f"{r['tree']}\n{r['optimizer']}" for r in rows]
    for ax, field, keys, scale, what in (
        (axes[0], "median_ms", list(rows[0]["median_ms"]), 1, "ms per call (median, slowest rank)"),
        (axes[1], "state_bytes", ["chain", "sharded"], 1e-6, "optimizer state, MB per device"),
    ):
        w = 0.8 / len(keys)
        for j, k in enumerate(keys):
            at = [i + j * w for i in range(len(rows))]
            ax.bar(at, [r[field][k] * scale for r in rows], w, label=k)
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(rows))], labels)
        ax.set_ylabel(what)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(
        f"sharded suite ({meta['mode']}: {meta['processes']} process(es) x "
        f"{meta['devices']} device(s), {meta['cpus']} CPUs)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_report(rows: list[dict], checks: list[dict], meta: dict) -> None:
    print(
        f"\nsharded suite, {meta['mode']}: {meta['processes']} process(es) x "
        f"{meta['devices']} device(s) on {meta['hosts']} host(s), {meta['cpus']} CPUs; "
        f"median of {meta['rounds']} rounds x {meta['iters']} calls, slowest rank; load "
        f"average {meta['loadavg'][0]:.1f}"
    )
    for r in rows:
        sb, eb, mb = r["state_bytes"], r["expected_bytes"], 1e6
        print(
            f"{r['tree']} {r['optimizer']}: {r['leaves']} leaves, {r['params'] / mb:.2f} M "
            f"params, N = {r['replicas']}\n  state per device: chain {sb['chain'] / mb:.3f} "
            f"MB, sharded {sb['sharded'] / mb:.3f} MB: {r['state_ratio']:.4f} (ceil(n/N)/n "
            f"{r['layout_ratio']:.4f}; the inner state of the slices {eb['sharded'] / mb:.3f} MB)"
        )
        for k in ("chain", "sharded"):
            items = [*r["step_memory"][k].items(), *r["hlo_ops"][k].items()]
            items.append(("compile_s", r["compile_s"][k]))
            print(f"  {k:<8} step bytes / HLO ops: " + " ".join(f"{a} {v}" for a, v in items))
        for k, v in r["median_ms"].items():
            cpu = r["cpu_busy"][k]
            print(
                f"  {k:<15} {v:>9.2f} ms  CPU busy {cpu['machine']:>4.0%} ranks {cpu['ranks']:.0%}"
            )
        print(
            f"  step sharded / chain {r['step_ratio']:.3f}; update slice / whole "
            f"{r['update_ratio']:.3f} (1/N = {1 / r['replicas']:.3f})"
        )
    print("targets:")
    for t in checks:
        ok = "ok" if t["ok"] else "MISSED"
        print(f"  {t['what']:<52} {t['value']:.3f} <= {t['limit']:.3f}  {ok}")


def _parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m jaxsync bench --suite sharded",
        description="jaxsync.sharded(inner) against optax.chain(hierarchical_mean(), "
        "inner): optimizer state bytes per device, the step's memory and time, the "
        "bare collectives and the update's own compute. Run plainly (one process, "
        "--devices fake devices) or under mpirun -n 2 (one device each).",
    )
    cases = {**CASES, **QUICK_CASES}
    p.add_argument("--quick", action="store_true", help="tiny trees, 2 rounds (smoke test)")
    p.add_argument("--devices", type=int, help="devices per process (default 4; mpirun: 1)")
    what = ", ".join(f"{k}: {v}" for k, v in cases.items())
    p.add_argument("--trees", nargs="+", choices=list(cases), help=f"cases ({what})")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 5)")
    p.add_argument("--iters", type=int, help="calls per sample (default 5)")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory")
    p.add_argument("--json", type=Path, default=None, help="also write the JSON record here")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.iters = args.iters or (2 if args.quick else 5)
    if min(args.rounds, args.iters, args.devices or 1) < 1:
        p.error("--rounds, --iters and --devices must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    from .world import mpi_world, set_devices

    comm = mpi_world()
    set_devices(args.devices or (1 if comm is not None else 4))
    import jax

    import jaxsync

    hosts = 1 if comm is None else jaxsync.topology(comm).hosts
    rank = 0 if comm is None else comm.Get_rank()
    t0 = time.perf_counter()
    rows = []
    for name in args.trees or list(QUICK_CASES if args.quick else CASES):
        opt = {**CASES, **QUICK_CASES}[name]
        if rank == 0:
            print(f"[{name} {opt}] ...", flush=True)
        rows.append(measure(name, opt, comm, args.rounds, args.iters))
    if rank != 0:
        return 0
    mode = "intra" if comm is None else ("cluster" if hosts > 1 else "shm")
    procs = 1 if comm is None else comm.Get_size()
    meta = dict(mode=mode, processes=procs, hosts=hosts, devices=jax.local_device_count())
    meta.update(rounds=args.rounds, iters=args.iters, quick=args.quick, cpus=os.cpu_count())
    meta.update(jax=jax.__version__)
    meta.update(loadavg=os.getloadavg(), seconds=round(time.perf_counter() - t0, 1))
    meta["date"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    checks = targets(rows, shared_memory=hosts == 1)
    print_report(rows, checks, meta)
    record = {"meta": meta, "rows": rows, "targets": checks}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"sharded-{meta['mode']}"
    for dest in [stem.with_suffix(".json")] + ([args.json] if args.json else []):
        dest.write_text(json.dumps(record, indent=1))
        print(f"wrote {dest}")
    save_plot(lambda png: plot(rows, meta, png), stem.with_suffix(".png"))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

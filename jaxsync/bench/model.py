"""``python -m jaxsync bench --suite model``: the cost model against measurements.

Per configuration (one process with ``--devices`` fake devices, or under
``mpirun -n P`` with ``--devices`` per process, also across hosts, e.g. inside
``python -m jaxsync cluster``, where the model uses the network link between
hosts and the configuration is named ``HOSTSxPROCSxDEVICES@LINK``): calibrate a profile (as
``python -m jaxsync tune`` does, or read ``--profile``), then time every
strategy and ``auto_mean`` on the bench's trees with the bench's own step and
statistics (``timing.run_tree``: marginal cost inside the README's
``jit(shard_map)`` step, median of interleaved rounds, slowest rank; the bare
collective beside them), and compare each strategy's measured marginal cost with
the model's prediction for its plan. The results go to
``--out/model-<P>x<D>.json``; every run then merges all ``model-*.json`` of
``--out`` into ``model.md`` (the table), ``model.json`` (the summary) and
``model.png`` (predicted against measured; ``jaxsync.bench.model_report``), so
running the configurations one after another builds the whole picture.
``--collect`` only merges.

Accuracy criteria of the issue (reported, never asserted): the prediction
within 25% of the measured marginal cost in at least 80% of the cases, and
``auto``'s measured cost within 10% of the best measured strategy in at least
90% of the cases.

May import: the standard library, numpy, JAX, mpi4py, jaxsync's public API, the
bench's own modules (cases, timing, trees, world, ``model_report``) and, as the
model under test has no public API, jaxsync's private ``_cost_ops``, ``_auto``,
``_plan`` and ``_tune``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from jaxsync.auto import _cost_ops

from . import cases, trees, world
from .methods import AXIS, LOCAL
from .model_report import AUTO_TOL, STRATEGIES, collect
from .timing import Case, compile_cases, run_tree

DEFAULT_TREES = ("resnet18", "small500", "transformer", "mixed")


def _methods(axis, comm, profile_json):
    import jaxsync

    common = dict(axis_name=axis, comm=comm)
    out = {
        "naive": jaxsync.naive_mean(**common),
        "flat": jaxsync.flat_mean(**common),
        "hierarchical": jaxsync.hierarchical_mean(**common),
        "two_dimensional": jaxsync.two_dimensional_mean(**common),
        "auto": jaxsync.auto_mean(**common, profile=profile_json),
    }
    return {k: _sync_fn(tx) for k, tx in out.items()}, out["auto"]


def _sync_fn(tx):
    return lambda g: tx.update(g, tx.init(g))[0]


def _strategy_cases(bench, arg, buf) -> list:
    """The two bases (the tree, one buffer of its bytes) and a case per method of
    ``bench.methods``, each marginal to the tree's base."""
    return [
        Case("base tree", "base", None, step=bench._step(None), arg=arg),
        Case("base buffer", "base", None, step=bench._step(None), arg=buf),
        *(
            Case(m, "jaxsync", "base tree", step=bench._step(s), arg=arg)
            for m, s in bench.methods.items()
        ),
    ]


def _psum_case(bench, kind: str, axis: str, buf):
    """A bare ``psum`` of the buffer over ``axis``, marginal to the buffer's base."""
    from jax import lax

    return Case(
        "psum bare", kind, "base buffer", step=bench._step(lambda b: lax.psum(b, axis)), arg=buf
    )


class ModelIntra(cases.IntraBench):
    """One process: strategies, auto and a bare ``psum``; nothing else."""

    def __init__(self, profile_json):
        super().__init__(sweeps=False)
        self.methods, self.auto = _methods(AXIS, None, profile_json)

    def cases(self, tree, sweep):
        import jax
        import jax.numpy as jnp

        arg = self._stacked(tree)
        buf = self._stacked(jax.ShapeDtypeStruct((trees.tree_info(tree)[2] // 4,), jnp.float32))
        cases = [*_strategy_cases(self, arg, buf), _psum_case(self, "bare", AXIS, buf)]
        compile_cases(cases, self.n, 1)
        return cases, {}


class ModelMPI(cases.MPIBench):
    """Under mpirun: strategies, auto, the bare allreduce (and psum with devices)."""

    def __init__(self, comm, devices, profile_json):
        super().__init__(comm, sweeps=False, devices=devices)
        self.methods, self.auto = _methods(LOCAL, comm, profile_json)

    def cases(self, tree, sweep):
        import jax
        import jax.numpy as jnp
        from mpi4py import MPI

        arg = self._stacked(tree)
        nbytes = trees.tree_info(tree)[2]
        buf = self._stacked(jax.ShapeDtypeStruct((nbytes // 4,), jnp.float32))
        cases = _strategy_cases(self, arg, buf)
        if self.n > 1:
            cases.append(_psum_case(self, "limit", LOCAL, buf))
        compile_cases(cases, self.n, self.procs)
        send = np.ones(nbytes // 4, np.float32)
        recv = np.ones_like(send)
        cases.append(
            Case(
                "mpi4py bare",
                "bare",
                None,
                arrays=1,
                ops=1,
                run=lambda: self.peer_comm.Allreduce(send, recv, op=MPI.SUM),
            )
        )
        return cases, {}


def predictions(tree, topo: _cost_ops.ModelTopology, profile) -> dict:
    """Predicted seconds of each strategy with the options its factory uses."""
    from jaxsync._core._plan import make_plan
    from jaxsync.auto._auto import buckets_of

    out = {}
    for s in STRATEGIES:
        bucket_bytes, threshold = _cost_ops.strategy_defaults(s)
        plan = make_plan(
            tree,
            bucket_bytes=bucket_bytes,
            pack_threshold=threshold,
            per_leaf=_cost_ops.per_leaf_plan(s, topo),
        )
        out[s] = _cost_ops.predict(s, buckets_of(plan), topo, profile, bucket_bytes=bucket_bytes)
    return out


def pool_same_programs(rows, methods) -> dict:
    """Per method of ``methods``: ``(median, q25, q75, pooled_with)`` of its
    marginal samples, pooled with those of the other methods that compiled to
    the very same program (equal hash of the lowered module, blind only to the
    digest and instance number of jaxsync's agreement check: the same
    collectives and copies, measured in separate cases). ``auto`` picking a
    strategy's plan is such a pair: its two rows differ only by the noise of
    the run, so both get the median of all their rounds, and the comparison of
    ``auto`` with the best strategy is the comparison of the pick with the
    best, not of two noisy measurements of one program.

    Example:
      >>> from types import SimpleNamespace as R
      >>> rows = [R(method="a", work="p1", samples_ms=[1.0, 3.0]),
      ...         R(method="b", work="p1", samples_ms=[2.0]),
      ...         R(method="c", work="p2", samples_ms=[5.0])]
      >>> got = pool_same_programs(rows, ["a", "b", "c"])
      >>> got["a"][0], got["b"][0], got["a"][3], got["c"]
      (2.0, 2.0, ['b'], (5.0, 5.0, 5.0, []))
    """
    by = {r.method: r for r in rows if r.method in methods}
    out = {}
    for m, r in by.items():
        mates = [o for o in by if o != m and r.work and by[o].work == r.work]
        x = np.asarray([v for k in (m, *mates) for v in by[k].samples_ms], np.float64)
        out[m] = (
            float(np.median(x)),
            float(np.quantile(x, 0.25)),
            float(np.quantile(x, 0.75)),
            mates,
        )
    return out


def _same_program(tree, topo, choice) -> bool:
    """Whether auto's choice plans ``tree`` as the chosen strategy's factory does."""
    from jaxsync._core._plan import make_plan

    b, t = _cost_ops.strategy_defaults(choice.strategy)
    per_leaf = _cost_ops.per_leaf_plan(choice.strategy, topo)
    group = lambda x: x if choice.strategy == "flat" and per_leaf else None  # noqa: E731
    mine = make_plan(tree, bucket_bytes=b, pack_threshold=t, per_leaf=per_leaf)
    got = make_plan(
        tree,
        bucket_bytes=choice.bucket_bytes,
        pack_threshold=choice.pack_threshold,
        per_leaf=per_leaf,
    )
    return mine.buckets == got.buckets and group(b) == group(choice.bucket_bytes)


def _parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m jaxsync bench --suite model",
        description="The cost model's predictions against measured marginal costs, and "
        "auto's pick against the best strategy (one configuration per run; "
        "the table and plot merge every run in --out).",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="fake CPU devices per process (default 8 alone, 1 under mpirun)",
    )
    p.add_argument(
        "--trees", nargs="+", default=None, help=f"bench trees (default: {' '.join(DEFAULT_TREES)})"
    )
    p.add_argument("--repeats", type=int, default=None, help="rounds (default 5, --quick 2)")
    p.add_argument(
        "--min-sample-ms",
        type=float,
        default=None,
        help="a sample lasts about this long (default 30, --quick 5)",
    )
    p.add_argument(
        "--profile", type=Path, default=None, help="use this profile instead of calibrating first"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="one tiny tree, a quick calibration, 2 rounds (a smoke test)",
    )
    p.add_argument(
        "--tune-host-allocator",
        action="store_true",
        help="call jaxsync.tune_host_allocator() first (calibrate the profile with "
        "`tune --tune-host-allocator` too): costs of large buffers no longer depend on "
        "the allocation history",
    )
    p.add_argument(
        "--collect", action="store_true", help="only merge the model-*.json already in --out"
    )
    p.add_argument("--out", type=Path, default=Path("bench-results/model"))
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 2 if args.quick else 5
    if args.min_sample_ms is None:
        args.min_sample_ms = 5.0 if args.quick else 30.0
    return args


def main(argv: list[str]) -> int:
    args = _parse(argv)
    if args.collect:
        s = collect(args.out)
        print((args.out / "model.md").read_text())
        return 0 if s["cases"] else 1
    comm = world.mpi_world()
    devices = args.devices or (1 if comm is not None else 8)
    world.set_devices(devices)
    import jax

    import jaxsync
    from jaxsync.auto import _auto, _tune

    if args.tune_host_allocator and not jaxsync.tune_host_allocator():
        raise SystemExit("jaxsync bench: --tune-host-allocator needs glibc; run without it.")

    rank = comm.Get_rank() if comm is not None else 0
    t0 = time.perf_counter()
    if args.profile is not None:
        profile, _ = _auto.load_profile(args.profile)
    else:
        profile = _tune.calibrate(comm, quick=args.quick)
    if rank == 0:
        _tune.print_fit(profile)
    pjson = profile.to_json()
    bench = ModelMPI(comm, devices, pjson) if comm is not None else ModelIntra(pjson)
    procs = 1 if comm is None else comm.Get_size()
    hosts = jaxsync.topology(comm).hosts  # the network link between hosts, if several
    topo = _cost_ops.ModelTopology(
        processes=procs,
        hosts=hosts,
        local_devices=devices,
        native=comm is not None,
        broadcast=comm is not None,
    )
    known = {**trees.make_trees(False), **trees.make_trees(True)}
    names = args.trees or (["mixed_tiny"] if args.quick else list(DEFAULT_TREES))
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(
            f"jaxsync bench --suite model: unknown tree(s) {unknown}; choose from {list(known)}"
        )
    results = []
    for name in names:
        tree = known[name]()
        rows, _ = run_tree(
            bench, name, tree, args.repeats, args.min_sample_ms / 1e3, 3 if args.quick else 15
        )
        by = {r.method: r for r in rows}
        pooled = pool_same_programs(rows, (*STRATEGIES, "auto"))
        pred = predictions(tree, topo, profile)
        choice = _auto.choose(tree, topo, profile)
        best = min(STRATEGIES, key=lambda s: pooled[s][0])
        same = _same_program(tree, topo, choice)
        auto_ms = pooled["auto"][0]
        results.append(
            {
                "tree": name,
                "leaves": by["auto"].leaves,
                "bytes": by["auto"].tree_bytes,
                "strategies": {
                    s: {
                        "measured_ms": pooled[s][0],
                        "q25_ms": pooled[s][1],
                        "q75_ms": pooled[s][2],
                        "alone_ms": by[s].median_ms,
                        "pooled_with": pooled[s][3],
                        "predicted_ms": pred[s] * 1e3,
                        "correct": by[s].correct,
                    }
                    for s in STRATEGIES
                },
                "bare_ms": next(r.median_ms for r in rows if r.kind == "bare"),
                "auto": {
                    "choice": choice.strategy,
                    "bucket_bytes": choice.bucket_bytes,
                    "pack_threshold": choice.pack_threshold,
                    "predicted_ms": choice.seconds * 1e3,
                    "measured_ms": auto_ms,
                    "alone_ms": by["auto"].median_ms,
                    "pooled_with": pooled["auto"][3],
                    "best": best,
                    "best_ms": pooled[best][0],
                    "same_program": same,
                    "strategy_ms": by[choice.strategy].median_ms if choice.strategy in by else None,
                    "ok": auto_ms <= (1 + AUTO_TOL) * pooled[best][0],
                    "correct": by["auto"].correct,
                },
            }
        )
    if rank != 0:
        return 0
    import os

    from jaxsync.auto._tune_tiers import cluster_link

    link = cluster_link()
    # on several hosts: HOSTSxPROCS-PER-HOSTxDEVICES[@LINK], as bench --suite cluster names them
    cfg = f"{procs}x{devices}"
    if hosts > 1:
        cfg = f"{hosts}x{procs // hosts}x{devices}" + (f"@{link['link']}" if link else "")
    meta = {
        "config": cfg,
        "hosts": hosts,
        "cluster": link,
        "host_tier": topo.tiered,
        "processes": procs,
        "devices": devices,
        "repeats": args.repeats,
        "min_sample_ms": args.min_sample_ms,
        "quick": args.quick,
        "host_allocator": jaxsync.host_allocator_state(),
        "loadavg": os.getloadavg(),
        "seconds": round(time.perf_counter() - t0, 1),
        "jax": jax.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"model-{cfg}.json"
    path.write_text(
        json.dumps({"config": cfg, "meta": meta, "profile": pjson, "trees": results}, indent=1)
    )
    print(f"wrote {path}")
    print(bench.auto.describe())
    s = collect(args.out)
    print((args.out / "model.md").read_text())
    print(f"wrote {args.out / 'model.md'}, {args.out / 'model.json'}, {args.out / 'model.png'}")
    return 0 if s["cases"] else 1

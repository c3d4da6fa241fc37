"""``python -m jaxsync bench [options]`` (also ``python -m jaxsync.bench``): the glue.

What it is for: parsing the options, dispatching ``--suite NAME`` to another
suite, choosing the mode (intra: one process; mpi: under mpirun), running every
tree and handing the rows to ``report``. What it may import: ``jaxsync`` (public
API), every ``jaxsync.bench`` module, and the suites it dispatches to.

Example:
  >>> from jaxsync.bench import cli
  >>> args = cli._parse(["--quick"])
  >>> args.repeats, args.min_sample_ms, str(args.out)
  (2, 5.0, 'bench-results')
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
import time
from pathlib import Path

from .cases import IntraBench, MPIBench
from .report import evaluate_targets, print_report, write_files
from .timing import run_tree
from .trees import make_trees
from .world import mpi_world, set_devices

SUITES = {
    "sparse": "jaxsync.bench.sparse",
    "compress": "jaxsync.bench.compress",
    "model": "jaxsync.bench.model",
    "cluster": "jaxsync.bench.cluster",
    "overlap": "jaxsync.bench.overlap",
    "sharded": "jaxsync.bench.sharded",
    "accumulate": "jaxsync.bench.accumulate",
    "weights": "jaxsync.bench.weights",
    "local-updates": "jaxsync.bench.local",
    "quant-quality": "jaxsync.bench.quality",
}
"""``--suite NAME``: the module whose ``main(argv)`` runs it."""

SUITE_HELP = {
    "sparse": "row-sparse gradients (embedding tables): all-gathers against dense syncs",
    "compress": "powersgd_mean, sign_mean and Quantized int8/int4: bytes, step cost, ring model",
    "model": "the cost model behind strategy='auto': predicted against measured (also "
    "inside `python -m jaxsync cluster`: scripts/model_accuracy_cluster.sh)",
    "cluster": "the MPI and compression suites inside the emulated cluster, beside the "
    "link's limit (hosts x processes x devices, 1 and 10 Gb/s)",
    "overlap": "a whole train step with overlap=True / double_buffering=True against "
    "the blocking sync, the step without sync and the bare allreduce",
    "sharded": "jaxsync.sharded(adam) against chain(hierarchical_mean, adam): optimizer "
    "state bytes per device, the step's memory and time, the update's own compute",
    "accumulate": "jaxsync.accumulate (one sync per k micro-steps) against optax.MultiSteps: "
    "bytes and time per k micro-steps",
    "weights": "weights=True with even inputs against the plain mean (float32 and bfloat16 "
    "wires): its cost",
    "local-updates": "a byte-level transformer LM: data parallel against DiLoCo, local SGD and "
    "streaming DiLoCo, eval loss against wall-clock and steps",
    "quant-quality": "digits MLP and byte-level LM trained through each wire format (float32, "
    "bfloat16, Quantized int8/e4m3/int4/e2m1): eval loss per seed against float32's spread",
}


def _parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jaxsync bench",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="other suites (python -m jaxsync bench --suite NAME --help for their "
        "options):\n" + "\n".join(f"  {k:<9} {v}" for k, v in SUITE_HELP.items()),
        description="Marginal cost of gradient synchronisation inside a jitted step: "
        "jaxsync's strategies against peers and the bare collective. Run "
        "plainly for one process with fake CPU devices, or under "
        "`mpirun -n 2` for the inter-process benchmark.",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="CPU devices per process (default: 8 in one process, 1 under mpirun; "
        "set before JAX starts). Under mpirun they form the local axis of "
        "the README's shard_map step",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="interleaved rounds per tree (default 5, --quick 2)",
    )
    p.add_argument(
        "--min-sample-ms",
        type=float,
        default=None,
        help="a sample is the median of enough calls to last about this long "
        "(default 50, --quick 5)",
    )
    p.add_argument(
        "--trees",
        nargs="+",
        default=None,
        help="subset of trees (default: resnet18 small500 transformer mixed)",
    )
    p.add_argument(
        "--tune-host-allocator",
        action="store_true",
        help="call jaxsync.tune_host_allocator() first (glibc keeps large buffers "
        "for reuse instead of page-faulting fresh ones in on every call), "
        "for jaxsync and the peers alike. Default: glibc's defaults, as a "
        "user's program has them; run both ways to see the difference",
    )
    p.add_argument(
        "--no-jax-distributed",
        action="store_true",
        help="under mpirun, leave out the jax.distributed peer (a global mesh and one "
        "pmean, gloo between processes; joining it starts JAX's multi-process runtime)",
    )
    p.add_argument(
        "--no-sweeps", action="store_true", help="skip the flat bucket_bytes / pack_threshold sweep"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="one tiny tree and 2 rounds (about 20 s; a smoke test, not a measurement)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("bench-results"),
        help="directory for <mode>.json, .csv and .png (default bench-results/)",
    )
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 2 if args.quick else 5
    if args.min_sample_ms is None:
        args.min_sample_ms = 5.0 if args.quick else 50.0
    if (
        args.repeats < 1
        or args.min_sample_ms < 0
        or (args.devices is not None and args.devices < 1)
    ):
        p.error("--repeats and --devices must be positive, --min-sample-ms >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """``python -m jaxsync bench [options]``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[0] == "--suite":  # another suite: SUITES[name].main
        if argv[1] not in SUITES:
            raise SystemExit(
                f"jaxsync bench: unknown suite {argv[1]!r}; choose from {', '.join(SUITES)}"
            )
        return importlib.import_module(SUITES[argv[1]]).main(argv[2:])
    args = _parse(argv)
    comm = mpi_world()
    devices = args.devices or (1 if comm is not None else 8)
    set_devices(devices)
    if comm is not None and not args.no_jax_distributed:
        from .jaxdist import init

        init(comm)
    if args.tune_host_allocator:
        import jaxsync

        tuned = jaxsync.tune_host_allocator()
    else:
        tuned = False

    import jax

    trees = make_trees(args.quick)
    names = args.trees or list(trees)
    unknown = [n for n in names if n not in trees]
    if unknown:
        raise SystemExit(f"jaxsync bench: unknown tree(s) {unknown}; choose from {list(trees)}")
    bench = (
        MPIBench(comm, not args.no_sweeps, devices)
        if comm is not None
        else IntraBench(not args.no_sweeps)
    )
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    iters_cap = 3 if args.quick else 25
    rows, skipped = [], {}
    for name in names:
        got, skipped[name] = run_tree(
            bench, name, trees[name](), args.repeats, args.min_sample_ms / 1e3, iters_cap
        )
        rows += got
    if bench.rank != 0:
        return 0
    meta = {
        "mode": bench.mode,
        "devices": devices,
        "processes": 1 if comm is None else comm.Get_size(),
        "repeats": args.repeats,
        "quick": args.quick,
        "min_sample_ms": args.min_sample_ms,
        "trees": names,
        "tune_host_allocator": tuned,
        "methods": list(dict.fromkeys(r.method for r in rows)),
        "sweep_skipped": {t: s for t, s in skipped.items() if s},
        "env": {
            k: v for k, v in os.environ.items() if k.startswith(("XLA_", "MALLOC_", "JAX_", "OMP_"))
        },
        "jax": jax.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
        "seconds": round(time.perf_counter() - t0, 1),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    targets = evaluate_targets(rows, devices)
    print_report(rows, targets, meta)
    for path in write_files(rows, targets, meta, args.out):
        print(f"wrote {path}")
    return 0

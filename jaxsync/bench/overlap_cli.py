"""``bench --suite overlap``'s arguments, its targets and its plot (``overlap``
runs the cases).

What it may import: the standard library and matplotlib (for the plot).
"""

from __future__ import annotations

import argparse
from pathlib import Path

MiB = 2**20
TRACE_STEPS = 3
"""Steps of the first overlap case recorded with the timeline, after the timed rounds."""
WIRES = ("float32", "int8", "e4m3", "int4", "e2m1")

# --xla-scheduler: XLA:CPU's scheduler for every case's step (jax.jit's
# compiler_options); "default" leaves XLA's choice.
SCHEDULERS = {"default": None, "memory": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


def _target(what: str, value: float, limit: float, at_least: bool = False) -> dict:
    ok = value >= limit if at_least else value <= limit
    return {"what": what, "value": value, "limit": limit, "ok": ok, "at_least": at_least}


def targets(med: dict, shared_memory: bool) -> list[dict]:
    """The issues' targets, each ``{"what", "value", "limit", "ok", "at_least"}``:
    issue 31's against max(nosync, forward + bare) (the forward pass comes before
    any gradient, so overlap cannot hide the sums behind it) and max(nosync, bare)."""
    floor = max(med["nosync"], med["bare"])
    reach = max(med["nosync"], med["forward"] + med["bare"])
    out = []
    for k in (k for k in med if k.startswith("overlap")):
        out.append(_target(f"{k} / max(nosync, bare)", med[k] / floor, 1.25))
        saved = (med["blocking"] - med[k]) / med["bare"]
        out.append(_target(f"(blocking - {k}) / bare", saved, 1 / 3, at_least=True))
        out.append(_target(f"{k} / max(nosync, forward + bare)", med[k] / reach, 1.05))
    out.append(_target("double / max(nosync, bare)", med["double"] / floor, 1.05))
    if shared_memory:
        for k in (k for k in med if k.startswith("overlap") or k in ("double", "default")):
            out.append(_target(f"{k} / blocking (shared memory)", med[k] / med["blocking"], 1.05))
    return out


def plot(med: dict, meta: dict, path: Path) -> None:
    """Bars of the median step time per case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(med)
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar(range(len(names)), [med[n] * 1e3 for n in names], color="tab:blue")
    ax.set_xticks(range(len(names)), names, rotation=20)
    ax.set_ylabel("ms per step (median)")
    ax.set_title(
        f"overlap suite ({meta['mode']}: {meta['processes']} processes on "
        f"{meta['hosts']} host(s)); {meta['gradient_bytes'] / 1e6:.1f} MB of gradients"
    )
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _bytes_list(text: str) -> list[int]:
    try:
        out = [int(float(v) * MiB) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--buckets takes MiB values separated by commas, e.g. 1,4,25; got {text!r}"
        ) from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"--buckets needs positive sizes, got {text!r}")
    return out


def _parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m jaxsync bench --suite overlap",
        description="Train-step time with overlap=True and double_buffering=True "
        "against the step without sync, the blocking sync and the bare allreduce. "
        "Run under mpirun -n 2 (shared memory) or on the emulated cluster.",
    )
    p.add_argument("--quick", action="store_true", help="a tiny model, 2 rounds (smoke test)")
    p.add_argument("--layers", type=int, default=None, help="dense layers (default 10)")
    p.add_argument("--width", type=int, default=None, help="layer width (default 724: 21 MB)")
    p.add_argument("--batch", type=int, default=None, help="batch per process (default 128)")
    p.add_argument(
        "--buckets",
        type=_bytes_list,
        default=None,
        help="overlap_bucket_bytes to time, MiB, comma-separated (default: 4)",
    )
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 7)")
    p.add_argument("--iters", type=int, default=None, help="calls per sample (default 5)")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory")
    p.add_argument(
        "--wire",
        choices=WIRES,
        default="float32",
        help="every case's comm_dtype: float32 (None) or a jaxsync.Quantized format "
        "(block 2048); the bare collective is then its all-to-all and all-gather",
    )
    p.add_argument(
        "--xla-scheduler",
        choices=tuple(SCHEDULERS),
        default="default",
        help="XLA:CPU's scheduler for every step (memory: CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED, "
        "which issues a quantized wire's buckets during the backward)",
    )
    p.add_argument(
        "--no-timeline",
        action="store_true",
        help="skip the timeline picture (by default the first overlap case runs "
        f"{TRACE_STEPS} more steps inside jaxsync.timeline after the timed rounds, drawn "
        "to overlap-<mode>-timeline.png)",
    )
    args = p.parse_args(argv)
    q = args.quick
    args.layers = args.layers or (3 if q else 10)
    args.width = args.width or (64 if q else 724)
    args.batch = args.batch or (16 if q else 128)
    args.buckets = args.buckets or ([1024] if q else [4 * MiB])
    args.rounds = args.rounds or (2 if q else 7)
    args.iters = args.iters or (2 if q else 5)
    if min(args.layers, args.width, args.batch, args.rounds, args.iters) < 1:
        p.error("--layers, --width, --batch, --rounds and --iters must be positive")
    return args

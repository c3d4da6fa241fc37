"""Benchmark of overlap and double buffering: ``python -m jaxsync bench --suite overlap``.

A whole training step (forward, backward, synchronisation, SGD update) of a
stack of dense ``tanh`` layers (``--layers`` x ``--width``, batch ``--batch``:
its compute of the order of the communication of its gradients), one device per
process, jitted with the parameters and the optimizer state donated. Timed, in
interleaved rounds (every sample the median of ``--iters`` calls, the slowest
rank's; the figure the median over rounds):

* ``nosync``: the step without synchronisation;
* ``blocking``: ``hierarchical_mean(overlap=False)`` (one blocking call after
  the whole gradient exists);
* ``overlap``: ``hierarchical_mean(overlap=True)`` for each ``--buckets`` size;
* ``double``: ``hierarchical_mean(double_buffering=True)`` (``overlap=False``);
* ``default``: ``hierarchical_mean()``, its defaults (``overlap="auto"``: the
  overlap case across hosts, the blocking one within a host);
* ``forward``: the forward pass alone (the loss);
* ``bare``: ``mpi4py`` ``Allreduce`` of the gradients' bytes (float32,
  preallocated, out of place); with ``--wire`` a ``jaxsync.Quantized`` format
  (every case's ``comm_dtype``, block 2048), the schedule's ``Alltoall`` of the
  codes and scales and its ``Allgather`` of one row.

Targets (the issues'): with overlap the step at most 1.25 x max(nosync, bare),
below blocking by at least a third of bare and (issue 31) at most 1.05 x
max(nosync, forward + bare); with double buffering at most 1.05 x max(nosync,
bare); in shared memory (one host) none slower than blocking by more than 5%.
Run it under ``mpirun -n 2`` (shared memory) and on the emulated cluster
(``python -m jaxsync cluster --hosts 2 --procs-per-host 1 --link 100mbit --
python -m jaxsync bench --suite overlap``: 100 Mb/s, where the wire sets the
time on this machine, and 1gbit). Writes ``overlap-<mode>.json``
and ``overlap-<mode>.png`` (matplotlib, if installed) to ``--out``.

Figures on a shared machine are noisy: read ratios from one run.

Beside each figure: the share of the machine's CPU time that was busy during
that case's timed calls (``timing.CpuMeter``: ``/proc/stat``, every process,
the kernel's network work included) and the ranks' own CPU share. After the
timed rounds the first overlap case runs ``TRACE_STEPS`` steps inside
``jaxsync.timeline``, drawn to ``overlap-<mode>-timeline.png`` (``--no-timeline``:
not).

What it may import: numpy, jax, optax, mpi4py, matplotlib (the plot), ``jaxsync``
(public API) and the other ``jaxsync.bench`` modules.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from jaxsync import wire_formats

from .report import draw_timeline, save_plot
from .timing import CpuMeter, ranks_share

# The suite's arguments, its targets and its plot.
MiB = 2**20
TRACE_STEPS = 3
"""Steps of the first overlap case recorded with the timeline, after the timed rounds."""
# --wire's choices: float32 and every block-quantized format of the registry
WIRES = ("float32", *(f.name for f in wire_formats(quantized=True)))

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


# The cases.


def make_params(layers: int, width: int):
    """The layer stack's parameters: a list of ``{"w", "b"}``, first layer first."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    key = jax.random.PRNGKey(0)
    return [
        {
            "w": jax.random.normal(jax.random.fold_in(key, i), (width, width)) / np.sqrt(width),
            "b": jnp.zeros((width,)),
        }
        for i in range(layers)
    ]


def loss(params, x):
    import jax.numpy as jnp

    h = x
    for layer in params:
        h = jnp.tanh(h @ layer["w"] + layer["b"])
    return jnp.mean(h**2)


def make_step(tx, lr: float = 1e-2, scheduler: str = "default"):
    """A jitted train step ``(params, state, x) -> (params, state)``, both donated;
    ``scheduler="memory"``: compiled with XLA:CPU's memory-optimized scheduler."""
    import jax
    import optax

    opt = optax.sgd(lr) if tx is None else optax.chain(tx, optax.sgd(lr))

    def step(p, s, x):
        g = jax.grad(loss)(p, x)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    options = {"xla_cpu_scheduler_type": SCHEDULERS[scheduler]} if scheduler != "default" else None
    return jax.jit(step, donate_argnums=(0, 1), compiler_options=options), opt


# --wire: comm_dtype for every case (float32: None); the bare collective beside
# a quantized wire is its schedule's: an all-to-all of n (b/8 + 4/B) bytes, then
# an all-gather of 1/N of them.


def wire_spec(wire: str):
    """``comm_dtype`` of ``--wire`` (``None`` for float32), from the registry."""
    return {f.name: f.comm_dtype for f in wire_formats()}[wire]


def _cases(comm, buckets, wire="float32"):
    import jaxsync

    q = wire_spec(wire)
    blocking = jaxsync.hierarchical_mean(None, comm, comm_dtype=q, overlap=False)
    cases = {"nosync": None, "blocking": blocking}
    for b in buckets:
        cases[f"overlap {b / MiB:g}MiB"] = jaxsync.hierarchical_mean(
            None, comm, comm_dtype=q, overlap=True, overlap_bucket_bytes=b
        )
    cases["double"] = jaxsync.hierarchical_mean(
        None, comm, comm_dtype=q, overlap=False, double_buffering=True
    )
    # the defaults (overlap="auto": on across hosts, off within one host)
    cases["default"] = jaxsync.hierarchical_mean(None, comm, comm_dtype=q)
    return cases


def _time(fn, iters, comm, meter=None):
    """Median seconds per call over ``iters`` calls, the slowest rank's; the calls'
    CPU use added to ``meter`` (a ``timing.CpuMeter``)."""
    from contextlib import nullcontext

    from mpi4py import MPI

    comm.Barrier()
    times = []
    with meter if meter is not None else nullcontext():
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return comm.allreduce(statistics.median(times), op=MPI.MAX)


def measure(
    comm,
    layers,
    width,
    batch,
    buckets,
    rounds,
    iters,
    trace_dir=None,
    wire="float32",
    scheduler="default",
):
    """Median step seconds per case (interleaved rounds) and the bare allreduce,
    the samples, the gradients' bytes and each case's CPU share
    (``{case: {"machine", "ranks"}}``, see ``timing.CpuMeter``). With
    ``trace_dir``, after the timed rounds: the first overlap case run
    ``TRACE_STEPS`` times inside ``jaxsync.timeline(trace_dir)``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from mpi4py import MPI

    params = make_params(layers, width)
    x = jax.random.normal(jax.random.PRNGKey(1 + comm.Get_rank()), (batch, width))
    nbytes = sum(int(a.size) * 4 for a in jax.tree.leaves(params))
    carry, steps = {}, {}
    for name, tx in _cases(comm, buckets, wire).items():
        step, opt = make_step(tx, scheduler=scheduler)
        p = jax.tree.map(jnp.copy, params)
        steps[name] = step
        carry[name] = (p, opt.init(p))

    def runner(name):
        def go():
            p, s = steps[name](*carry[name], x)
            jax.block_until_ready((p, s))
            carry[name] = (p, s)

        return go

    send = np.ones(nbytes // 4, np.float32)
    recv = np.empty_like(send)
    q, N = wire_spec(wire), comm.Get_size()
    if q is not None:  # the schedule's bytes: codes and scales, N rows, then a row each
        row = q.wire_bytes(-(-(nbytes // 4) // N))
        rows, got = np.ones((N, row), np.uint8), np.empty((N, row), np.uint8)

    def bare():
        if q is None:
            comm.Allreduce(send, recv, op=MPI.SUM)
        else:
            comm.Alltoall(rows, got)
            comm.Allgather(rows[0], got)

    forward = jax.jit(loss)
    fns = {name: runner(name) for name in steps}
    fns["forward"] = lambda: jax.block_until_ready(forward(params, x))
    fns["bare"] = bare
    for fn in fns.values():  # compile and warm up
        for _ in range(2):
            fn()
    samples: dict = {k: [] for k in fns}
    meters = {k: CpuMeter() for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            samples[k].append(_time(fn, iters, comm, meters[k]))
    machine, ranks = ranks_share(list(meters.values()), comm)
    cpu = {k: {"machine": m, "ranks": r} for k, m, r in zip(meters, machine, ranks)}
    if trace_dir is not None:  # after the timed rounds: it costs them nothing
        import jaxsync

        traced = next(k for k in fns if k.startswith("overlap"))
        with jaxsync.timeline(trace_dir) as tl:
            for i in range(TRACE_STEPS):
                with tl.step(f"{traced} {i}"):
                    fns[traced]()
        comm.Barrier()  # every rank's file written before rank 0 draws them
    med = {k: statistics.median(v) for k, v in samples.items()}
    return med, samples, nbytes, cpu


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    from .world import mpi_world

    comm = mpi_world()
    if comm is None:
        raise SystemExit(
            "jaxsync bench --suite overlap measures MPI between processes: run it under "
            "`mpirun -n 2`, or on the emulated cluster (`python -m jaxsync cluster "
            "--hosts 2 --procs-per-host 1 --link 1gbit -- python -m jaxsync bench "
            "--suite overlap`)."
        )
    import jax

    import jaxsync

    tuned = jaxsync.tune_host_allocator()
    hosts = jaxsync.topology(comm).hosts
    mode = ("cluster" if hosts > 1 else "shm") + ("" if args.wire == "float32" else f"-{args.wire}")
    mode += "" if args.xla_scheduler == "default" else f"-{args.xla_scheduler}"
    trace_dir = None if args.no_timeline else args.out / f"overlap-{mode}-timeline"
    med, samples, nbytes, cpu = measure(
        comm,
        args.layers,
        args.width,
        args.batch,
        args.buckets,
        args.rounds,
        args.iters,
        trace_dir,
        args.wire,
        args.xla_scheduler,
    )
    if comm.Get_rank() != 0:
        return 0
    checks = targets(med, shared_memory=hosts == 1)
    floor = max(med["nosync"], med["bare"])
    print(
        f"\noverlap suite, {mode}: {comm.Get_size()} processes on {hosts} host(s), "
        f"{args.layers} layers x {args.width}, batch {args.batch}, "
        f"{nbytes / 1e6:.1f} MB of gradients, wire {args.wire}; median of {args.rounds} rounds x "
        f"{args.iters} calls, slowest rank; load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'case':<16} {'ms/step':>9} {'/max(nosync,bare)':>18} {'/blocking':>10} "
        f"{'CPU busy':>9} {'ranks CPU':>10}"
    )
    for k, v in med.items():
        print(
            f"{k:<16} {v * 1e3:>9.1f} {v / floor:>18.2f} {v / med['blocking']:>10.2f} "
            f"{cpu[k]['machine']:>9.0%} {cpu[k]['ranks']:>10.0%}"
        )
    print(
        "CPU busy: share of the machine's CPU time busy during the case's timed calls "
        "(/proc/stat, every process); ranks CPU: the ranks' own CPU seconds over wall "
        "x cores. Low: the wire set the time; near 100%: the CPUs did, or MPI polled "
        "while it waited (bare against the bytes over the link rate tells which)."
    )
    print("targets:")
    for t in checks:
        op = ">=" if t.get("at_least") else "<="
        print(
            f"  {t['what']:<44} {t['value']:6.2f} {op} {t['limit']:.2f}  "
            + ("ok" if t["ok"] else "MISSED")
        )
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "mode": mode,
        "processes": comm.Get_size(),
        "hosts": hosts,
        "devices": jax.local_device_count(),
        "layers": args.layers,
        "width": args.width,
        "batch": args.batch,
        "gradient_bytes": nbytes,
        "wire": args.wire,
        "xla_scheduler": args.xla_scheduler,
        "rounds": args.rounds,
        "iters": args.iters,
        "quick": args.quick,
        "host_allocator_tuned": bool(tuned),
        "loadavg": os.getloadavg(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path = args.out / f"overlap-{mode}.json"
    record = {
        "meta": meta,
        "median_s": med,
        "cpu_busy": cpu,
        "samples_s": samples,
        "targets": checks,
    }
    if trace_dir is not None:
        png = args.out / f"overlap-{mode}-timeline.png"
        record["timeline"] = got = draw_timeline(trace_dir, png)
        print(f"wrote {got and got['png']}")
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")
    save_plot(lambda png: plot(med, meta, png), args.out / f"overlap-{mode}.png")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

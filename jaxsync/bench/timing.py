"""Timing of the benchmark's cases: compile, check, time interleaved, slowest rank.

What it is for: a ``Case`` is one timed thing on one tree (a jitted step, or a
host-side callable); ``run_tree`` compiles a bench's cases for one tree, checks
that every method gives the mean, times every case once per round (rounds
interleaved, order rotated), takes every sample as the slowest rank's, and makes
one ``Row`` per case: the *marginal* cost, the case minus its base case, per round.
What it may import: numpy, jax, mpi4py (only through the bench's communicator),
the standard library, and ``jaxsync.bench.trees`` / ``jaxsync.bench.hlo``.

Example:
  >>> from jaxsync.bench import timing
  >>> seconds, faults = timing.time_calls(lambda: None, iters=3)
  >>> seconds >= 0
  True
  >>> meter = timing.CpuMeter()
  >>> with meter:
  ...     _ = sum(range(10_000))
  >>> 0.0 <= meter.machine <= 1.0 or meter.machine != meter.machine  # NaN: no /proc/stat
  True
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .hlo import collective_stats, hlo_collectives
from .trees import SWEEP_TREES, MiB, tree_info


@dataclasses.dataclass
class Case:
    """One timed thing on one tree: a jitted step, or a host-side callable."""

    method: str
    kind: str  # "base", "jaxsync", "peer", "bare", "limit", "sweep"
    base: str | None  # the case whose time is subtracted (None: raw time)
    step: Any = None  # a jitted step, compiled by compile_cases ...
    arg: Any = None  # ... and called on this argument
    run: Callable[[], Any] | None = None
    arrays: int = 0  # arrays handed to collectives (jaxpr)
    ops: int = 0  # collective instructions (compiled HLO)
    wire_bytes: float = 0.0
    compile_s: float = 0.0
    program: str = ""  # hash of the lowered program: equal hash, same program
    work: str = ""  # the same hash, blind to the agreement check's digest and instance


_AGREEMENT = re.compile(r"agree_(?:id|instance) = -?\d+ : i64")
"""The attributes of jaxsync's agreement check that differ between programs of
the same work: the digest of the configuration's text (which names options
such as ``bucket_bytes`` even where the plan is the same) and the number of the
traced synchronisation on this process."""


def _compile(lowered):
    t0 = time.perf_counter()
    compiled = lowered.compile()
    return compiled, time.perf_counter() - t0


def compile_cases(cases: list[Case], axis_size: int, procs: int) -> None:
    """Trace every jitted step in order (under MPI, tracing is collective),
    count its collectives, and compile each distinct program once, in threads.

    Steps with ordered effects (mpi4jax's primitives) cannot be called through
    the ahead-of-time API: their first ``jit`` call compiles them, in order on
    every process, after the others.
    """
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    import jax

    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        futures = {}
        for c in cases:
            if c.step is None:
                continue
            traced = c.step.trace(c.arg)
            c.arrays, c.wire_bytes = collective_stats(traced.jaxpr, axis_size, procs)
            lowered = traced.lower()
            text = lowered.as_text()
            c.program = hashlib.sha1(text.encode()).hexdigest()[:8]
            c.work = hashlib.sha1(_AGREEMENT.sub("", text).encode()).hexdigest()[:8]
            if traced.jaxpr.effects:
                c.ops = hlo_collectives(text)  # MPI custom calls are never combined
            elif c.program not in futures:
                futures[c.program] = pool.submit(_compile, lowered)
        for c in cases:
            if c.step is None:
                continue
            if c.program in futures:
                compiled, c.compile_s = futures[c.program].result()
                c.ops = hlo_collectives(compiled.as_text())
                c.run = functools.partial(compiled, c.arg)
            else:
                c.run = functools.partial(c.step, c.arg)
                t0 = time.perf_counter()
                jax.block_until_ready(c.run())
                c.compile_s = time.perf_counter() - t0


def cpu_ticks() -> tuple[int, int]:
    """``(busy, total)`` clock ticks of all the machine's CPUs since boot, from the
    first line of ``/proc/stat`` (``(0, 0)`` where there is none): busy is every
    field but idle and iowait (user, nice, system, irq, softirq, steal - the
    kernel's TCP and ``tc`` shaping work included, whoever it runs for)."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(v) for v in fh.readline().split()[1:9]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields)
    return total - idle, total


def own_cpu_s() -> float:
    """CPU seconds (user + system, every thread) this process has used."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class CpuMeter:
    """How busy the CPUs were while timed things ran: a context manager that adds
    up, over every ``with`` block, the machine's busy and total ticks
    (:func:`cpu_ticks`), this process's CPU seconds and the wall seconds.

    ``machine``: the share of all the machine's CPU time that was busy (any
    process: the ranks, the kernel's network work, and whatever else runs);
    ``own``: this process's CPU seconds over wall seconds x cores. A row whose
    ``machine`` share is low was waiting (on the wire); near 1, the CPUs set the
    time. Sum ``own_s`` over the ranks for the ranks' share (:func:`ranks_share`).
    """

    def __init__(self) -> None:
        self.busy = self.total = 0
        self.own_s = self.wall_s = 0.0
        self._start: tuple = ()

    def __enter__(self) -> CpuMeter:
        self._start = (*cpu_ticks(), own_cpu_s(), time.perf_counter())
        return self

    def __exit__(self, *exc) -> None:
        b0, t0, o0, w0 = self._start
        b1, t1 = cpu_ticks()
        self.busy += b1 - b0
        self.total += t1 - t0
        self.own_s += own_cpu_s() - o0
        self.wall_s += time.perf_counter() - w0

    @property
    def machine(self) -> float:
        return self.busy / self.total if self.total > 0 else float("nan")

    @property
    def own(self) -> float:
        cores = os.cpu_count() or 1
        return self.own_s / (self.wall_s * cores) if self.wall_s > 0 else float("nan")


def ranks_share(meters: list[CpuMeter], comm=None) -> tuple[list[float], list[float]]:
    """Per meter: the machine's busy share (the busiest rank's reading: on a real
    cluster each host has its own CPUs) and the ranks' share (their CPU seconds
    summed over the ranks, over the slowest rank's wall seconds x this machine's
    cores: all ranks on one machine, as in the emulated cluster). Collective
    over ``comm`` (None: this process alone)."""
    machine = np.array([m.machine for m in meters], np.float64)
    own = np.array([m.own_s for m in meters], np.float64)
    wall = np.array([m.wall_s for m in meters], np.float64)
    if comm is not None:
        from mpi4py import MPI

        machine = np.nan_to_num(machine, nan=-1.0)
        comm.Allreduce(MPI.IN_PLACE, machine, op=MPI.MAX)
        machine[machine < 0] = np.nan
        comm.Allreduce(MPI.IN_PLACE, own, op=MPI.SUM)
        comm.Allreduce(MPI.IN_PLACE, wall, op=MPI.MAX)
    cores = os.cpu_count() or 1
    ranks = np.where(wall > 0, own / np.maximum(wall, 1e-12) / cores, np.nan)
    return [round(float(x), 3) for x in machine], [round(float(x), 3) for x in ranks]


def time_calls(
    fn: Callable[[], Any], iters: int, barrier=None, meter: CpuMeter | None = None
) -> tuple[float, float]:
    """Median seconds of ``iters`` calls of ``fn`` (each blocked until ready) and
    the minor page faults per call. ``barrier`` synchronises processes first;
    ``meter`` adds up the calls' CPU use."""
    import contextlib

    import jax

    if barrier is not None:
        barrier()
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    times = []
    with meter if meter is not None else contextlib.nullcontext():
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - t0)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / iters
    return statistics.median(times), faults


@dataclasses.dataclass
class Row:
    """One result: the marginal cost of one method on one tree."""

    mode: str
    tree: str
    method: str
    kind: str
    leaves: int
    params: int
    tree_bytes: int
    wire_bytes: int
    arrays: int
    ops: int
    median_ms: float
    q25_ms: float
    q75_ms: float
    min_ms: float
    max_ms: float
    ratio_to_bare: float
    faults_per_call: float
    compile_s: float
    program: str
    iters: int
    correct: bool | None  # the result is the mean (None: not a mean)
    samples_ms: list[float]
    work: str = ""  # Case.work: equal for programs that differ only in the agreement check
    # The share of the machine's CPU time busy during this case's timed calls
    # (CpuMeter.machine, the busiest rank's) and the ranks' own (ranks_share).
    cpu_busy: float = float("nan")
    cpu_ranks: float = float("nan")


def check_results(cases: list[Case]) -> dict[str, bool]:
    """Whether each method averaging the base tree's gradients gives their mean.

    Every replica computes the same gradients (from the same input), so the
    mean is each replica's own value: a wrong divisor, a lost or mixed-up leaf
    shows. Tolerance: a few ULP of the travelling dtype (bfloat16 for the
    ``bf16`` methods). Runs collectives: every process checks, in case order.
    """
    import jax

    from .jaxdist import local

    def result(c: Case):
        assert c.run is not None, c.method  # compiled by compile_cases
        return local(jax.block_until_ready(c.run()))

    bases = {c.method: result(c) for c in cases if c.kind == "base" and "tree" in c.method}
    out = {}
    for c in cases:
        if c.base not in bases or c.kind == "base":
            continue
        want = bases[c.base]
        got = result(c)
        ok = str(jax.tree.structure(got)) == str(jax.tree.structure(want))
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)) if ok else ():
            g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
            bits = (
                8
                if "bf16" in c.method or str(w.dtype) == "bfloat16"
                else (11 if str(w.dtype) == "float16" else 24)
            )
            ok = (
                ok
                and g.shape == w.shape
                and bool(np.all(np.abs(g64 - w64) <= 4.0 * 2.0**-bits * np.abs(w64)))
            )
        out[c.method] = ok
    return out


def make_rows(
    mode, tree_name, info, cases, iters, samples, faults, correct=None, cpu=None
) -> list[Row]:
    """Marginal statistics per case; ``samples[r, i]``: round r, case i (seconds);
    ``cpu``: ``(machine, ranks)`` shares per case (``ranks_share``)."""
    machine, ranks = cpu or ([float("nan")] * len(cases), [float("nan")] * len(cases))
    index = {c.method: i for i, c in enumerate(cases)}
    samples = np.asarray(samples) * 1e3
    faults = np.median(np.asarray(faults), axis=0)

    def marginal(c):
        i, j = index[c.method], index.get(c.base)
        if j is None:
            return samples[:, i], faults[i]
        return samples[:, i] - samples[:, j], faults[i] - faults[j]

    bare = next(float(np.median(marginal(c)[0])) for c in cases if c.kind == "bare")
    leaves, params, nbytes = info
    rows = []
    for c in cases:
        if c.kind == "base":
            continue
        m, f = marginal(c)
        med = float(np.median(m))
        rows.append(
            Row(
                mode,
                tree_name,
                c.method,
                c.kind,
                leaves,
                params,
                nbytes,
                int(c.wire_bytes),
                c.arrays,
                c.ops,
                med,
                float(np.quantile(m, 0.25)),
                float(np.quantile(m, 0.75)),
                float(m.min()),
                float(m.max()),
                med / bare if bare > 0 else float("nan"),
                float(f),
                round(c.compile_s, 3),
                c.program,
                int(iters[index[c.method]]),
                (correct or {}).get(c.method),
                [round(float(x), 4) for x in m],
                c.work,
                machine[index[c.method]],
                ranks[index[c.method]],
            )
        )
    return rows


def _log(bench, msg):
    if bench.rank == 0:
        print(f"[bench] {msg}", file=sys.stderr, flush=True)


def run_tree(
    bench, tree_name: str, tree, repeats: int, min_sample_s: float, max_iters: int
) -> tuple[list[Row], dict]:
    """Compile, warm up, calibrate and time every case of one tree, interleaved."""
    info = tree_info(tree)
    _log(
        bench,
        f"{tree_name}: {info[0]} leaves, {info[1] / 1e6:.2f}M params, "
        f"{info[2] / MiB:.1f} MiB; compiling",
    )
    t0 = time.perf_counter()
    cases, skipped = bench.cases(tree, bench.sweeps and tree_name in SWEEP_TREES)
    t1 = time.perf_counter()
    correct = check_results(cases)
    # Warm up (first runs, allocator) and calibrate: a sample is the median of
    # enough calls to last about min_sample_s; every process uses the same counts.
    warm = np.array([time_calls(c.run, 2, bench.barrier)[0] for c in cases])
    if bench.comm is not None:
        from mpi4py import MPI

        bench.comm.Allreduce(MPI.IN_PLACE, warm, op=MPI.MAX)
    iters = np.clip(np.ceil(min_sample_s / np.maximum(warm, 1e-6)), 1, max_iters).astype(int)
    _log(
        bench,
        f"{tree_name}: {len(cases)} cases ({len({c.program for c in cases})} "
        f"programs) compiled in {t1 - t0:.0f} s; timing {repeats} rounds",
    )
    samples = np.zeros((repeats, len(cases)))
    faults = np.zeros((repeats, len(cases)))
    meters = [CpuMeter() for _ in cases]
    for r in range(repeats):
        k = r % len(cases)  # rotate the order so no case always follows the same one
        for i in [*range(k, len(cases)), *range(k)]:
            samples[r, i], faults[r, i] = time_calls(
                cases[i].run, iters[i], bench.barrier, meters[i]
            )
    if bench.comm is not None:  # a step is done when the slowest process is
        from mpi4py import MPI

        bench.comm.Allreduce(MPI.IN_PLACE, samples, op=MPI.MAX)
    cpu = ranks_share(meters, bench.comm)
    rows = make_rows(bench.mode, tree_name, info, cases, iters, samples, faults, correct, cpu)
    return rows, skipped

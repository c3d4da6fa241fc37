"""The timeline: when each inter-process call ran, per rank, as a Chrome trace.

``jaxsync.timeline(DIR)`` (a context manager) or ``JAXSYNC_TIMELINE=DIR`` (the
whole run) turns on the native target's recorder (``jaxsync_timeline_enable``):
every call that talks MPI records its kind, communicator, bytes, and when it
was queued (a sum on a communication lane, ``overlap``), started and ended, on
which thread. Nothing of it is in the lowered step; off, a call pays one
relaxed atomic load. On leaving, each rank writes ``DIR/rank{R}.json`` in the
Chrome trace event format (Perfetto, ``chrome://tracing``): a lane per thread
(the steps marked with :meth:`Timeline.step`, XLA's threads that made calls,
each communicator's lane), one complete event per call with its communicator
(world, per device, the host tier's host and leaders communicators), bytes,
queueing time, step and place in the step (``call``: the n-th call of its kind
on its communicator in that step; ``bucket`` for overlap's sums, one a bucket)
in its arguments; the pipelined tier's one call is kind ``tier``. ``python -m jaxsync timeline DIR``
(``jaxsync._cli._timeline``) merges the ranks into one trace and draws them.

Times are ``CLOCK_MONOTONIC`` (Python's ``time.monotonic_ns``) from the moment
the timeline began on that rank: the context manager starts after a barrier of
the world communicator (every process must enter it, as it must make the
transforms), so the ranks' clocks line up within a barrier's skew, also across
hosts; with the environment variable each rank counts from its own start.
Timelines may be open together (a block inside the variable's whole run, or
nested blocks): each gets every call made while it was open.

Imports: ``_mpi_load`` (the native library) and ``_topology`` (rank, labels).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from . import _mpi_load, _topology

TIMELINE_ENV = "JAXSYNC_TIMELINE"
"""A directory: record the whole run's timeline there (one file per rank, at exit)."""

KINDS = (
    "allreduce",
    "allreduce_async",
    "allgather",
    "alltoall",
    "reduce",
    "bcast",
    "reduce_scatter",
    "agree",
    "tier",
)  # the native target's TimelineKind, in order
_FIELDS = 8  # kind, comm, bytes, queued, started, ended, thread, lane


def _lib(load: bool):
    """The native library with the timeline's entry points, or ``None``: not
    built, or not loaded and ``load`` false (one process without MPI: loading it
    would initialise MPI here)."""
    if not load and not _mpi_load.native_loaded():
        return None
    try:
        lib = _mpi_load._native()
    except Exception:  # noqa: BLE001 - no native target: a timeline of steps only
        return None
    if not hasattr(lib, "jaxsync_timeline_drain"):
        return None
    lib.jaxsync_timeline_drain.restype = ctypes.c_int64
    lib.jaxsync_timeline_drain.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.jaxsync_timeline_pending.restype = ctypes.c_int64
    return lib


def _drain(lib) -> np.ndarray:
    """Every recorded event, removed from the native recorder: ``(n, 8)`` int64."""
    chunks = []
    while True:
        n = int(lib.jaxsync_timeline_pending())
        if n == 0:
            break
        buf = np.empty((n, _FIELDS), np.int64)
        got = int(lib.jaxsync_timeline_drain(buf.ctypes.data, n))
        chunks.append(buf[:got])
    return np.concatenate(chunks) if chunks else np.empty((0, _FIELDS), np.int64)


_open: list[Timeline] = []  # the timelines recording now (nested, or with the variable's)


def _collect(lib) -> None:
    """Drain the recorder into every open timeline (one recorder, several readers:
    a ``with jaxsync.timeline`` block inside ``JAXSYNC_TIMELINE``'s whole run
    takes nothing away from it). With none open, the events are dropped."""
    events = _drain(lib)
    if len(events):
        for tl in _open:
            tl._events.append(events)


_seen: dict[int, str] = {}  # the names of communicators since freed (at exit)


def label(handle: int, text: str) -> None:
    """Name a communicator jaxsync made outside its cache (``jaxsync.local``'s
    in-flight lane) in the timeline."""
    _seen[int(handle)] = text


def _remember() -> None:
    _seen.update(comm_labels())


_topology.before_free.append(_remember)


def comm_labels() -> dict[int, str]:
    """Communicator handles (``py2f``) of every jaxsync communicator, named
    (also those freed since the process started: at exit they go first)."""
    labels: dict[int, str] = dict(_seen)
    for comms in list(_topology.Comms._cache.values()):
        if comms.freed:
            continue
        try:
            labels.update(_labels_of(comms))
        except Exception:  # noqa: BLE001 - not an mpi4py communicator (a test's stand-in)
            continue
    return labels


def _labels_of(comms) -> dict[int, str]:
    labels = {comms.world.py2f(): "world", comms.agreement.py2f(): "agreement"}
    for d, c in enumerate(comms._devices):
        labels.setdefault(c.py2f(), f"world, device {d}")
    tier = comms.tier
    if tier is not None:
        for d, (h, x) in enumerate(zip(tier.host, tier.cross)):
            labels[h.py2f()] = f"host, device {d}"
            labels[x.py2f()] = (
                f"leaders, device {d}" if tier.local_rank == 0 else f"cross, device {d}"
            )
    return labels


class Timeline:
    """Records the inter-process calls of this process; see :func:`timeline`."""

    def __init__(self, directory: str | os.PathLike, *, barrier: bool = True):
        self.directory = Path(directory)
        self.barrier = barrier
        self.path: Path | None = None
        self._steps: list[tuple[Any, int, int]] = []
        self._lib = None
        self._events: list[np.ndarray] = []
        self._t0 = 0
        self._rank = 0

    def __enter__(self) -> Timeline:
        comm = _topology.default_comm()
        self._rank = 0 if comm is None else comm.Get_rank()
        if comm is not None and self.barrier:
            _topology.Comms.of(comm).control.Barrier()
        self._lib = _lib(load=comm is not None)
        if self._lib is not None:
            _collect(self._lib)  # what came before goes to the timelines already open
        self._t0 = time.monotonic_ns()
        self._events = []
        _open.append(self)
        if self._lib is not None:
            self._lib.jaxsync_timeline_enable(1)
        return self

    @contextlib.contextmanager
    def step(self, index: Any = None):
        """Mark one training step (its start and end) on the steps' lane.

        Block on the step's results inside the ``with`` (``jax.block_until_ready``)
        so that its end is the end of its work, not of its dispatch.
        """
        start = time.monotonic_ns()
        try:
            yield
        finally:
            name = len(self._steps) if index is None else index
            self._steps.append((name, start, time.monotonic_ns()))

    def __exit__(self, *exc) -> None:
        lib = self._lib if self._lib is not None else _lib(load=False)
        if lib is not None:
            _collect(lib)
        if self in _open:
            _open.remove(self)
        if lib is not None and not _open:  # the last one open: recording stops
            lib.jaxsync_timeline_enable(0)
        events = np.concatenate([np.empty((0, _FIELDS), np.int64), *self._events])
        self._events = []
        self.path = write(
            self.directory,
            self._rank,
            events,
            self._steps,
            self._t0,
            comm_labels(),
            native=self._lib is not None,
        )


def timeline(directory: str | os.PathLike) -> Timeline:
    """Record when each inter-process call runs, per rank, as a Chrome trace.

    Inside the ``with`` block every call of jaxsync's native target that talks
    MPI (CPU, ``staging="device"``) is recorded: its kind, communicator, bytes,
    when it was queued, started and ended, and on which thread. On leaving,
    each process writes ``directory/rank{R}.json`` (Chrome's trace event
    format: open it in Perfetto or ``chrome://tracing``), and
    ``python -m jaxsync timeline DIR`` merges the ranks into one trace and
    draws a lane per rank and thread (``DIR/timeline.json``,
    ``DIR/timeline.png``). Mark the steps with ``tl.step()`` to see them
    beside their calls. Under MPI every process must enter the block (it starts
    with a barrier, so the ranks' times line up). ``JAXSYNC_TIMELINE=DIR``
    records the whole run, written at exit; a block inside it (or inside
    another block) records its own calls and takes none from the other. Nothing changes in the
    compiled step; when off, each call pays one atomic load.

    Args:
      directory: where each rank writes its file (made if missing).

    Returns:
      a context manager; ``with jaxsync.timeline(d) as tl:`` gives a
      :class:`Timeline` whose ``step()`` marks a step and whose ``path`` (after
      the block) is this rank's file.

    Example:
      >>> import json, tempfile, jax.numpy as jnp, jaxsync
      >>> d = tempfile.mkdtemp()
      >>> with jaxsync.timeline(d) as tl:
      ...     with tl.step():
      ...         _ = (jnp.ones(3) * 2).block_until_ready()
      >>> trace = json.loads(tl.path.read_text())
      >>> [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"]
      ['step 0']
    """
    return Timeline(directory)


def _us(ns: int, t0: int) -> float:
    return (int(ns) - t0) / 1e3


def write(directory, rank, events, steps, t0, labels, native=True) -> Path:
    """This rank's Chrome trace file; returns its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}},
        {"ph": "M", "name": "thread_name", "pid": rank, "tid": 0, "args": {"name": "steps"}},
    ]
    for name, start, end in steps:
        out.append(
            dict(
                ph="X",
                name=f"step {name}",
                cat="step",
                pid=rank,
                tid=0,
                ts=_us(start, t0),
                dur=(end - start) / 1e3,
                args={"step": name},
            )
        )
    tids: dict[tuple, int] = {}
    rows = sorted(events.tolist(), key=lambda e: e[3] if e[3] >= 0 else e[4])  # queued or began
    counts: dict[tuple, int] = {}
    for kind, comm, nbytes, queued, start, end, thread, lane in rows:
        label = labels.get(int(comm), f"communicator {int(comm)}")
        key = ("lane", label) if lane else ("thread", thread)
        if key not in tids:
            tids[key] = len(tids) + 1
            what = f"communication lane ({label})" if lane else f"XLA thread {len(tids)}"
            out.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": rank,
                    "tid": tids[key],
                    "args": {"name": what},
                }
            )
        step = next((n for n, s, e in steps if s <= start <= e), None)
        args = {"communicator": label, "bytes": int(nbytes), "step": step}
        # its place among the step's calls of this kind on this communicator, in
        # the order they were issued: with overlap (allreduce_async) the bucket
        key_n = (step, int(kind), int(comm))
        args["call"] = counts[key_n] = counts.get(key_n, -1) + 1
        if KINDS[int(kind)] == "allreduce_async":
            args["bucket"] = args["call"]
        if queued >= 0:
            args["queued_us"] = round((start - queued) / 1e3, 3)
        out.append(
            dict(
                ph="X",
                name=KINDS[int(kind)],
                cat="communication",
                pid=rank,
                tid=tids[key],
                ts=_us(start, t0),
                dur=(end - start) / 1e3,
                args=args,
            )
        )
    path = directory / f"rank{rank}.json"
    doc = {
        "traceEvents": out,
        "displayTimeUnit": "ms",
        "otherData": {
            "rank": rank,
            "clock": "CLOCK_MONOTONIC, us from the timeline's start",
            "native": bool(native),
        },
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)
    return path


_from_env: list[Timeline] = []


def start_from_env() -> None:
    """``JAXSYNC_TIMELINE=DIR``: record the whole run, written at exit (once)."""
    directory = os.environ.get(TIMELINE_ENV, "").strip()
    if not directory or _from_env:
        return
    tl = Timeline(directory, barrier=False)
    tl.__enter__()
    _from_env.append(tl)
    atexit.register(tl.__exit__, None, None, None)

"""Optional stall watchdog for the MPI stage (Horovod's stall check in spirit).

With ``timeout=T`` on a transform, local device 0 of every process tells a
watchdog thread when it enters and leaves each inter-process stage (two tiny host
callbacks with a real data dependency on the MPI calls). When this process has
waited more than ``T`` seconds inside one stage, its watchdog asks the others,
over a private communicator, how many stages they have entered and prints which
ranks have not arrived (or did not answer at all). The synchronisation itself
goes on waiting: when the straggler arrives the result is the same as without
the watchdog.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time

import jax
import numpy as np
from jax import lax
from jax.experimental import io_callback

_QUERY, _REPLY = 7101, 7102


class Watchdog:
    """One per communicator and process; started on first use."""

    def __init__(self, comm, timeout: float, stream=None):
        self.comm = comm  # a private duplicate, used by this thread only
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout = float(timeout)
        self.stream = stream or sys.stderr
        self.entered = 0
        self.left = 0
        self.t_enter = 0.0
        self.reports: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reported = -1
        self._round = 0
        self._thread = threading.Thread(target=self._loop, name="jaxsync-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    # -- called from the device thread through host callbacks -----------------
    def enter(self, x):
        with self._lock:
            self.entered += 1
            self.t_enter = time.monotonic()
        return x

    def leave(self, x):
        with self._lock:
            self.left += 1
        return x

    # -- the thread --------------------------------------------------------------
    def _serve(self):
        from mpi4py import MPI

        status = MPI.Status()
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_QUERY, status=status):
            src = status.Get_source()
            round_ = self.comm.recv(source=src, tag=_QUERY)
            with self._lock:
                state = (round_, self.entered, self.left)
            self.comm.send(state, dest=src, tag=_REPLY)

    def _loop(self):
        poll = min(0.05, self.timeout / 4)
        # Wakes up as soon as stop() is called (never sleeps through it), so
        # stop() returns before the communicator is freed or MPI finalized.
        while not self._stop.is_set():
            self._serve()
            with self._lock:
                waiting = self.entered > self.left
                seq, since = self.entered, time.monotonic() - self.t_enter
            if waiting and since > self.timeout and self._reported != seq:
                self._reported = seq
                self._report(seq, since)
            self._stop.wait(poll)
        self._serve()

    def _report(self, seq: int, since: float):
        from mpi4py import MPI

        self._round += 1
        round_ = self._round  # replies to an earlier round arrive late: ignored
        others = [r for r in range(self.size) if r != self.rank]
        for r in others:
            self.comm.send(round_, dest=r, tag=_QUERY)
        answers: dict[int, tuple] = {}
        deadline = time.monotonic() + max(1.0, self.timeout)
        status = MPI.Status()
        while (
            len(answers) < len(others) and time.monotonic() < deadline and not self._stop.is_set()
        ):
            self._serve()
            if self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_REPLY, status=status):
                src = status.Get_source()
                got, entered, left = self.comm.recv(source=src, tag=_REPLY)
                if got == round_:
                    answers[src] = (entered, left)
            else:
                self._stop.wait(0.01)
        if self._stop.is_set():
            return
        behind = [
            f"{r} (entered {answers[r][0]})" for r in others if r in answers and answers[r][0] < seq
        ]
        silent = [str(r) for r in others if r not in answers]
        parts = []
        if behind:
            parts.append(f"ranks not arrived: {', '.join(behind)}")
        if silent:
            parts.append(
                f"ranks not answering (dead, or busy outside jaxsync): {', '.join(silent)}"
            )
        if not parts:
            parts.append("every rank has arrived; the collective itself is slow")
        msg = (
            f"jaxsync watchdog: rank {self.rank} has waited {since:.1f} s in "
            f"inter-process synchronisation #{seq}; " + "; ".join(parts)
        )
        self.reports.append(msg)
        print(msg, file=self.stream, flush=True)

    def stop(self):
        """Stop the thread and wait for it (before the communicator is freed)."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            # The loop notices within one poll; a send to a dead rank could block
            # longer, so the wait is bounded.
            self._thread.join(timeout=30.0)

    # -- in-graph hooks ---------------------------------------------------------
    def wrap(self, program, when=None):
        """``program(ops, bufs)`` with enter/leave callbacks data-tied to its calls.

        ``when``: a traced boolean scalar; the callbacks count only where it is
        true (local device 0), ``None``: always.
        """

        def wrapped(ops, bufs):
            bufs = list(bufs)
            bufs[0] = _tie(self.enter, bufs[0], when)
            out = list(program(ops, bufs))
            out[0] = _tie(self.leave, out[0], when)
            return out

        return wrapped


def _tie(fn, x, when=None):
    """Call ``fn`` on the host; later uses of ``x`` depend on the call (1 element).

    An ``io_callback`` (a side effect: JAX may neither drop nor repeat it, as it
    may a ``pure_callback``), unordered (ordered effects are refused in
    multi-device computations); the data dependency orders it. Under ``vmap`` it
    runs once per mapped replica, on every process alike. With ``when`` (a
    boolean scalar), ``fn`` runs only where it is true (the leader device).
    """
    if x.size == 0:
        return x
    head = lax.slice(x, (0,), (1,))
    if when is None:
        head = io_callback(
            lambda h: np.asarray(fn(h)), jax.ShapeDtypeStruct((1,), x.dtype), head, ordered=False
        )
    else:
        head = io_callback(
            lambda h, w: np.asarray(fn(h) if w else h),
            jax.ShapeDtypeStruct((1,), x.dtype),
            head,
            when,
            ordered=False,
        )
    return lax.dynamic_update_slice(x, head, (0,))

"""Optional stall watchdog for the MPI stage (Horovod's stall check in spirit).

With ``timeout=T`` on a transform, one device of every process tells a
watchdog thread when it enters and leaves each inter-process stage (two tiny
host callbacks with a real data dependency on the MPI calls). A
synchronisation's first stage is entered before its agreement, so a first
execution that waits there (a rank still compiling, or never coming) is
watched too. When this process has waited more than ``T`` seconds inside one
stage, its watchdog asks the others, over a private communicator, how far they
have come, and prints which ranks have not arrived (or did not answer at all),
naming the synchronisation and its step.

``on_timeout="report"``: the synchronisation goes on waiting; when the
straggler arrives the result is the same as without the watchdog.
``on_timeout="abort"``: the watchdog also sends its diagnosis to every other
process (whose watchdog prints it too, once) and ends the job with
``MPI_Abort``, the only way out of a blocked MPI call. That path needs nothing
but this thread and MPI: its messages are never waited for, so it ends a job
whose peer is dead or unreachable as well (that peer is named as not
answering), and if ``MPI_Abort`` itself cannot return (the process manager
cannot reach every host), a process of its own kills this one 10 s later.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

import jax
import numpy as np
from jax import lax
from jax.experimental import io_callback

_QUERY, _REPLY, _ABORT = 7101, 7102, 7103
_ABORT_CODE = 1  # MPI_Abort's error code: the job's exit status under mpirun
_ABORT_GRACE = 2.0  # seconds the others get to print before MPI_Abort
_EXIT_AFTER = 10.0  # seconds after MPI_Abort: SIGKILL anyway (process manager gone)


def _kill_later(seconds: float) -> None:
    """SIGKILL this process after ``seconds``, from a process of its own."""
    import subprocess

    _KILLERS.append(
        subprocess.Popen(
            ["/bin/sh", "-c", f"sleep {seconds:g}; kill -KILL {os.getpid()} 2>/dev/null"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    )


_KILLERS: list = []  # kept: a Popen dropped while its process runs warns


class Watchdog:
    """One per communicator, timeout and action, per process; started when made."""

    def __init__(self, comm, timeout: float, on_timeout: str = "report", stream=None):
        self.comm = comm  # a private duplicate, used by this thread only
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout = float(timeout)
        self.on_timeout = on_timeout
        self.stream = stream or sys.stderr
        self.entered = 0  # stages entered, all synchronisations
        self.left = 0
        self.t_enter = 0.0  # when the latest stage was entered
        self.where = ("an inter-process synchronisation", 0)  # its (name, step)
        self.steps: dict[str, int] = {}  # stage name -> times entered
        self.reports: list[str] = []
        self._open: set = set()  # sites of the stages this process is in
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reported = -1
        self._round = 0
        self._final = False  # printed the message that ends the job
        self._sent: list = []  # requests of isends, never waited for
        self._thread = threading.Thread(target=self._loop, name="jaxsync-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    # -- called from the device thread through host callbacks -----------------
    def enter(self, x, site=None, name=None):
        """Stage ``site`` (named ``name``) entered; again while in it: nothing."""
        with self._lock:
            if site not in self._open:
                self._open.add(site)
                self.entered += 1
                name = name or "an inter-process synchronisation"
                step = self.steps[name] = self.steps.get(name, 0) + 1
                self.t_enter = time.monotonic()
                self.where = (name, step)
        return x

    def leave(self, x, site=None):
        with self._lock:
            if site in self._open:
                self._open.discard(site)
                self.left += 1
        return x

    # -- the thread --------------------------------------------------------------
    def _post(self, obj, dest: int, tag: int) -> None:
        """Send without waiting (a peer may be dead, or unreachable for good)."""
        self._sent = [r for r in self._sent if not r.Test()]
        self._sent.append(self.comm.isend(obj, dest=dest, tag=tag))

    def _serve(self):
        from mpi4py import MPI

        status = MPI.Status()
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_ABORT, status=status):
            src = status.Get_source()
            text = self.comm.recv(source=src, tag=_ABORT)
            text = text.removeprefix("jaxsync watchdog: ")
            self._end(
                f"jaxsync watchdog: rank {self.rank} ends the job, told by rank {src}: {text}"
            )
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_QUERY, status=status):
            src = status.Get_source()
            round_ = self.comm.recv(source=src, tag=_QUERY)
            with self._lock:
                state = (round_, self.entered, self.left, dict(self.steps))
            self._post(state, src, _REPLY)

    def _loop(self):
        try:
            self._watch()
        except Exception as e:
            if not _lost_peer(e):
                raise
            # ULFM (mpirun --with-ft ulfm): a peer was lost, or a survivor revoked
            # this communicator to recover (jaxsync.elastic). The step that waited
            # raises into the program; the watchdog stands aside, quietly.
            self._stop.set()

    def _watch(self):
        poll = min(0.05, self.timeout / 4)
        # Wakes up as soon as stop() is called (never sleeps through it), so
        # stop() returns before the communicator is freed or MPI finalized.
        while not self._stop.is_set():
            self._serve()
            with self._lock:
                waiting = bool(self._open)
                seq, since = self.entered, time.monotonic() - self.t_enter
                where = self.where
            if waiting and since > self.timeout and self._reported != seq:
                self._reported = seq
                self._report(seq, since, where)
            self._stop.wait(poll)
        self._serve()

    def _report(self, seq: int, since: float, where: tuple):
        from mpi4py import MPI

        name, step = where
        self._round += 1
        round_ = self._round  # replies to an earlier round arrive late: ignored
        others = [r for r in range(self.size) if r != self.rank]
        for r in others:
            self._post(round_, r, _QUERY)
        answers: dict[int, tuple] = {}
        deadline = time.monotonic() + max(1.0, min(self.timeout, 10.0))
        status = MPI.Status()
        while (
            len(answers) < len(others) and time.monotonic() < deadline and not self._stop.is_set()
        ):
            self._serve()
            if self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_REPLY, status=status):
                src = status.Get_source()
                got, entered, _, *more = self.comm.recv(source=src, tag=_REPLY)
                if got == round_:
                    answers[src] = (entered, more[0] if more else None)
            else:
                self._stop.wait(0.01)
        if self._stop.is_set():
            return
        behind = []
        for r in others:
            if r not in answers:
                continue
            entered, steps = answers[r]
            if steps is not None and name in steps:  # how often it entered this one
                if steps[name] < step:
                    behind.append(f"{r} (at step {steps[name]} of it)")
            elif steps is not None and step > 0:
                behind.append(f"{r} (never entered it)")
            elif entered < seq:
                behind.append(f"{r} (entered {entered})")
        silent = [str(r) for r in others if r not in answers]
        parts = []
        if behind:
            parts.append(f"ranks not arrived: {', '.join(behind)}")
        if silent:
            parts.append(
                "ranks not answering (dead, unreachable, or busy outside jaxsync): "
                + ", ".join(silent)
            )
        if not parts:
            parts.append("every rank has arrived; the collective itself is slow")
        msg = (
            f"jaxsync watchdog: rank {self.rank} has waited {since:.1f} s in "
            f"inter-process synchronisation {name}, step {step} (stage #{seq} of this "
            "process); " + "; ".join(parts)
        )
        if self.on_timeout != "abort":
            self.reports.append(msg)
            print(msg, file=self.stream, flush=True)
            return
        msg += f"; ending the job (on_timeout='abort', timeout={self.timeout:g} s)"
        for r in others:
            self._post(msg, r, _ABORT)
        self._end(msg, grace=_ABORT_GRACE)

    def _end(self, msg: str, grace: float = 0.0) -> None:
        """Print ``msg`` (once per process) and end the job with MPI_Abort."""
        if not self._final:
            self._final = True
            self.reports.append(msg)
            print(msg, file=self.stream, flush=True)
        if grace:  # the others print their line before the job goes
            time.sleep(grace)
        try:
            sys.stdout.flush()
            self.stream.flush()
        except Exception:  # noqa: BLE001 - ending anyway
            pass
        # MPI_Abort ends every process of the job; should it not return (its
        # process manager cannot reach every host), this process ends on its own.
        # Not a Python timer: mpi4py's Abort holds the GIL while it blocks.
        _kill_later(_EXIT_AFTER)
        try:
            self.comm.Abort(_ABORT_CODE)
        finally:
            os._exit(_ABORT_CODE)

    def stop(self):
        """Stop the thread and wait for it (before the communicator is freed)."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            # The loop notices within one poll; a send to a dead rank could block
            # longer, so the wait is bounded.
            self._thread.join(timeout=30.0)

    # -- in-graph hooks ---------------------------------------------------------
    def wrap(self, program, site, name, when=None, entered=False):
        """``program(ops, bufs)`` with enter/leave callbacks data-tied to its calls.

        ``site``: this stage's identity (one per traced stage); ``name``: the
        synchronisation it belongs to, whose steps are counted. ``when``: a
        traced boolean scalar; the callbacks run only where it is true (local
        device 0), ``None``: always. ``entered``: the stage was entered already
        (before the agreement, see :meth:`enter_before`): leave only.
        """

        def wrapped(ops, bufs):
            bufs = list(bufs)
            if not entered:
                bufs[0] = _tie(lambda h: self.enter(h, site, name), bufs[0], when)
            out = list(program(ops, bufs))
            k = next((i for i, y in enumerate(out) if y.size), None)
            if k is not None:
                out[k] = _tie(lambda h: self.leave(h, site), out[k], when)
            return out

        return wrapped

    def enter_before(self, x, site, name, when=None):
        """``x`` (one element or more) computed after stage ``site`` is entered."""
        return _tie(lambda h: self.enter(h, site, name), x, when)

    def leave_after(self, x, site, when=None):
        """``x`` (one element or more), stage ``site`` left once it is computed."""
        return _tie(lambda h: self.leave(h, site), x, when)


def _lost_peer(e: BaseException) -> bool:
    """Whether ``e`` is ULFM's process failure or revocation (mpi4py's error class)."""
    from mpi4py import MPI

    names = ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
    return isinstance(e, MPI.Exception) and e.Get_error_class() in [
        getattr(MPI, n, -1) for n in names
    ]


def _tie(fn, x, when=None):
    """Call ``fn`` on the host; later uses of ``x`` depend on the call (1 element).

    An ``io_callback`` (a side effect: JAX may neither drop nor repeat it, as it
    may a ``pure_callback``), unordered (ordered effects are refused in
    multi-device computations); the data dependency orders it. Under ``vmap`` it
    runs once per mapped replica, on every process alike (``Watchdog.enter``
    and ``leave`` are idempotent for one site). With ``when`` (a boolean
    scalar), ``fn`` runs only where it is true (the leader device).
    """
    if x.size == 0:
        return x
    shape, x = x.shape, x.reshape(-1)
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
    return lax.dynamic_update_slice(x, head, (0,)).reshape(shape)

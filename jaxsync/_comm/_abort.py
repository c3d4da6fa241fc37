"""Ending the job when one process raises uncaught while the others wait.

A process that raises before a collective (a trace-time refusal, a bug in its
own code) leaves its peers blocked in MPI: until the stall watchdog fires
(``timeout=``), or for ever without one. Once jaxsync has been set up over MPI
with more than one process (an MPI transform made, ``broadcast_params``
called), an exception that reaches the top of the main thread is printed as
usual (by whatever ``sys.excepthook`` was installed before, which stays in the
chain) and then ends the job with ``MPI_Abort``: every process exits non-zero
at once. The explanation goes to stderr in one ``write`` (past Python's
buffers; ``fsync``'d where stderr is a file), Python's traceback and
jaxsync's note together (with a hook of the user's, the exception's text once
more after it), and the abort waits :data:`GRACE_S` for the launcher to
forward it: where every rank raises the same error, the first abort would
otherwise kill the others, and the launcher's forwarding, while they print.
``JAXSYNC_ABORT_ON_ERROR=0`` turns this off (read when the hook is installed).
Exceptions in other threads do not end a Python process either, so
``threading.excepthook`` is left alone.

Imports: the standard library only (mpi4py through the communicator given).
"""

from __future__ import annotations

import os
import stat
import sys
import time
import traceback

ENV = "JAXSYNC_ABORT_ON_ERROR"
#: Seconds between printing the explanation and ``MPI_Abort``: the launcher's
#: time to forward it (measured: 3 of 10 runs lost it without, under load).
GRACE_S = 1.0

_state: dict = {}  # "comm", "previous": set once installed


def install(comm) -> None:
    """Abort the job over ``comm`` on an uncaught exception (once; a no-op
    with one process or ``JAXSYNC_ABORT_ON_ERROR=0``)."""
    if _state or os.environ.get(ENV, "1").strip() in ("0", "false", "False", "no"):
        return
    if not _is_mpi(comm):
        return  # a stand-in (tests), never a job to end
    try:
        if comm.Get_size() <= 1:
            return
    except Exception:  # noqa: BLE001 - not an MPI communicator: nothing to end
        return
    _state["comm"], _state["previous"] = comm, sys.excepthook
    sys.excepthook = _hook


def _is_mpi(comm) -> bool:
    """Whether ``comm`` is an mpi4py communicator."""
    return type(comm).__module__.split(".")[0] == "mpi4py"


def installed() -> bool:
    """Whether the hook is installed on this process."""
    return bool(_state)


def _hook(kind, value, tb) -> None:
    previous = _state.get("previous") or sys.__excepthook__
    if issubclass(kind, KeyboardInterrupt):
        _call(previous, kind, value, tb)
        return  # the launcher passes ^C to every process itself
    comm = _state["comm"]
    try:
        rank = comm.Get_rank()
    except Exception:  # noqa: BLE001
        rank = "?"
    note = (
        f"jaxsync: rank {rank} raised {kind.__name__} uncaught; ending the MPI job "
        f"(MPI_Abort) so that the other processes do not wait for it. {ENV}=0 "
        "turns this off.\n"
    )
    _flush()
    if previous is sys.__excepthook__:  # the traceback and the note in one write
        text = "".join(traceback.format_exception(kind, value, tb)) + note
    else:  # the user's hook prints as it will; the explanation again, in one write
        _call(previous, kind, value, tb)
        _flush()
        text = f"{note.rstrip()} It was:\n{''.join(traceback.format_exception_only(kind, value))}"
    write_now(text)
    # Every rank may be here at once (the same error everywhere): the first
    # MPI_Abort kills the others and the launcher's forwarding of what is still
    # in its pipes (4 of 10 runs under load showed a cut traceback). Give it a
    # moment to carry this rank's text to the terminal first.
    time.sleep(GRACE_S)
    comm.Abort(1)


def _call(hook, kind, value, tb) -> None:
    try:
        hook(kind, value, tb)
    except Exception:  # noqa: BLE001 - a failing hook must not keep the job alive
        sys.__excepthook__(kind, value, tb)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass


def write_now(text: str, fd: int = 2) -> None:
    """Write ``text`` to ``fd`` in one ``write`` (looping only on a short one),
    past Python's buffers, then ``fsync`` it where it is a regular file."""
    data = text.encode("utf-8", "backslashreplace")
    try:
        while data:
            data = data[os.write(fd, data) :]
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.fsync(fd)
    except OSError:  # a closed or broken stderr: nothing more to do before the abort
        pass

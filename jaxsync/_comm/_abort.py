"""Ending the job when one process raises uncaught while the others wait.

A process that raises before a collective (a trace-time refusal, a bug in its
own code) leaves its peers blocked in MPI: until the stall watchdog fires
(``timeout=``), or for ever without one. Once jaxsync has been set up over MPI
with more than one process (an MPI transform made, ``broadcast_params``
called), an exception that reaches the top of the main thread is printed as
usual (by whatever ``sys.excepthook`` was installed before, which stays in the
chain) and then ends the job with ``MPI_Abort``: every process exits non-zero
at once. ``JAXSYNC_ABORT_ON_ERROR=0`` turns this off (read when the hook is
installed). Exceptions in other threads do not end a Python process either, so
``threading.excepthook`` is left alone.

Imports: the standard library only (mpi4py through the communicator given).
"""

from __future__ import annotations

import os
import sys

ENV = "JAXSYNC_ABORT_ON_ERROR"

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
    try:
        previous(kind, value, tb)
    except Exception:  # noqa: BLE001 - a failing hook must not keep the job alive
        sys.__excepthook__(kind, value, tb)
    if issubclass(kind, KeyboardInterrupt):
        return  # the launcher passes ^C to every process itself
    comm = _state["comm"]
    try:
        rank = comm.Get_rank()
    except Exception:  # noqa: BLE001
        rank = "?"
    sys.stderr.write(
        f"jaxsync: rank {rank} raised {kind.__name__} uncaught; ending the MPI job "
        f"(MPI_Abort) so that the other processes do not wait for it. {ENV}=0 "
        "turns this off.\n"
    )
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    comm.Abort(1)

"""Runs one rank's program and prefixes each line it prints with ``[hostH rR]``.

Started by ``mpirun`` in place of the program (``_inside.mpirun_cmd``). Line by
line, so ranks printing at once never cut into each other's lines (hydra's own
prefix marks each write, not each line). The program keeps every file descriptor
(PMI's among them), dies with this process, and its exit status is this one's.
For the supervisor it writes ``$JAXSYNC_CLUSTER_EXITS/rank{R}.pid`` when it starts
and ``rank{R}.exit`` (the status) when the program ends: MPICH's hydra (5.0) does
not stop the other hosts' ranks when a rank fails, nor when a rank's MPI_Abort
cannot reach a host, so the supervisor ends the job itself.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def main(argv: list[str]) -> int:
    rank = os.environ.get("PMI_RANK", "?")
    tag = f"[host{os.environ.get('JAXSYNC_CLUSTER_HOST', '?')} r{rank}] "
    report = os.environ.get("JAXSYNC_CLUSTER_EXITS")
    if report:  # the supervisor watches this process: gone without a status = killed
        _write(os.path.join(report, f"rank{rank}.pid"), str(os.getpid()))
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        close_fds=False,
        preexec_fn=_die_with_parent,
    )
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, f: proc.send_signal(s))
    out = sys.stdout.buffer
    assert proc.stdout is not None
    for line in iter(proc.stdout.readline, b""):
        out.write(tag.encode() + line + (b"" if line.endswith(b"\n") else b"\n"))
        out.flush()
    rc = proc.wait()
    rc = 128 - rc if rc < 0 else rc
    if report:
        _write(os.path.join(report, f"rank{rank}.exit"), str(rc))
    return rc


def _write(path: str, text: str) -> None:
    """Write ``path`` whole or not at all: the supervisor reads it at any moment
    (an empty pid file once read as a dead rank, and ended a healthy job)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""What the multi-process harnesses share (``mpi/mpi_harness.py``, ``slurm/slurm_harness.py``).

CI detection; the mark of tests that need a program this machine may lack (a skip
here, a failure in CI); a command run in its own process group, the whole group
killed past its timeout (a hang fails the test instead of blocking the suite); and
what such a run returns. Importable from every folder of the suite: pytest puts
``tests/`` on ``sys.path`` when it loads ``tests/conftest.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest


def in_ci() -> bool:
    """Whether the ``CI`` environment variable is set (to anything but 0, false, no)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def requirement(lacking: bool, reason: str, ci_fixture: str):
    """The mark of tests that need what ``lacking`` says is missing: nothing where it
    is there, a skip with ``reason`` where it is not, and in CI the fixture named
    ``ci_fixture`` (which fails the test: CI must run it)."""
    if not lacking:
        return pytest.mark.skipif(False, reason="")
    if in_ci():
        return pytest.mark.usefixtures(ci_fixture)
    return pytest.mark.skipif(True, reason=reason)


class Run:
    """A finished command: its exit code, combined output, seconds and whether it timed out."""

    def __init__(self, cmd, returncode, output, elapsed, timed_out):
        self.cmd = cmd
        self.returncode = returncode
        self.output = output
        self.elapsed = elapsed
        self.timed_out = timed_out

    def describe(self) -> str:
        state = "TIMED OUT" if self.timed_out else f"exit code {self.returncode}"
        return (
            f"$ {' '.join(map(str, self.cmd))}\n{state} after {self.elapsed:.1f} s\n"
            f"----- output -----\n{self.output}\n------------------"
        )


def run_in_group(cmd: list, timeout: float, env: dict, cwd, grace: float = 5.0):
    """Run ``cmd`` in its own process group, stdin closed; ``(returncode, output,
    timed_out)``. Never blocks past ``timeout``: then the whole group is killed
    (:func:`kill_group` with ``grace``)."""
    proc = subprocess.Popen(
        [str(c) for c in cmd],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd=str(cwd),
        start_new_session=True,
        text=True,
        errors="replace",
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output, False
    except subprocess.TimeoutExpired:
        kill_group(proc, grace)
        output, _ = proc.communicate()
        return proc.returncode, output, True


def kill_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """Kill the process group ``proc`` leads (it was started with a new session):
    SIGTERM and up to ``grace`` seconds for ``proc`` to exit (none: ``grace`` 0), then
    SIGKILL to whatever of the group is left."""
    if grace > 0:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass

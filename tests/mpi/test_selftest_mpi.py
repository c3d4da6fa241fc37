"""``python -m jaxsync selftest`` under mpirun: passes on a sound launch, fails on
every rank (non-zero exit) when the ranks disagree (here: their device counts)."""

import os
import sys

from mpi_harness import MPIRUN, ROOT, requires_mpi, run_command

pytestmark = requires_mpi


def _env():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _selftest(devices):
    """``mpirun`` with one ``-n 1 ... --devices D`` block per rank (MPMD)."""
    cmd = [str(MPIRUN)]
    for i, d in enumerate(devices):
        cmd += [":"] if i else []
        cmd += ["-n", "1", sys.executable, "-m", "jaxsync", "selftest", "--mbytes", "1"]
        cmd += ["--iters", "2", "--devices", str(d)]
    return run_command(cmd, timeout=240, env=_env())


def test_selftest_passes_on_two_processes():
    rc, out, timed_out = _selftest([2, 2])
    assert not timed_out and rc == 0, out[-3000:]
    assert "selftest passed" in out
    for case in ("hierarchical bf16", "two_dimensional host", "flat", "naive"):
        assert case in out, out[-3000:]
    assert "processes of a host (MPI, shared memory)" in out
    assert "devices of a process (psum)" in out


def test_selftest_fails_when_the_ranks_disagree():
    rc, out, timed_out = _selftest([1, 2])
    assert not timed_out, out[-3000:]
    assert rc != 0, out[-3000:]
    assert "processes drive different numbers of devices: [1, 2]" in out
    assert "selftest FAILED" in out

"""Issue 27's MPI items: count limits, the all-to-all's shape check, concurrent
agreements (``worker_robust.py``), and stalls that end the job
(``worker_stall.py``). Every job runs under ``mpirun`` with a timeout.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi_harness import requires_mpi, run_mpi

pytestmark = requires_mpi


def _bitwise(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape)
    if got.tobytes() != want.tobytes():
        bits = f"u{got.itemsize}"
        bad = np.flatnonzero(got.reshape(-1).view(bits) != want.reshape(-1).view(bits))
        pytest.fail(f"{what}: {bad.size} of {got.size} elements differ, first at {bad[0]}")


def _ok(run, rank, key):
    got = run.results[rank][key]
    if isinstance(got, str):
        pytest.fail(f"rank {rank} {key}: {got}\n{run.describe()}", pytrace=False)
    return got


# --------------------------------------------------------------------------
# Defect 2: no leaf of 2^31 elements or more could be synced (MPI's int count).


@pytest.mark.parametrize("procs", [2, 3])
def test_native_calls_split_past_the_int_count(tmp_path, procs):
    """Leaves past the (lowered) count limit: the 16-bit sum (2 processes: the
    user operation; 3: the all-to-all), a float32 sum, all-gather and
    all-to-all, bit for bit."""
    run = run_mpi(
        "worker_robust.py", n=procs, devices=1, timeout=120, out=tmp_path, args=("--mode", "large")
    ).check()
    for rank in range(procs):
        sync = _ok(run, rank, "sync")
        for leaf in ("b", "f"):
            _bitwise(sync["got"][leaf], sync["want"][leaf], f"rank {rank} sync leaf {leaf}")
        for key in ("allgather", "allgather-bf16", "alltoall"):
            got = _ok(run, rank, key)
            _bitwise(got["got"], got["want"], f"rank {rank} {key}")


# --------------------------------------------------------------------------
# Defect 7: the all-to-all checked the element count, not the leading axis.


def test_native_alltoall_checks_the_leading_axis(tmp_path):
    run = run_mpi(
        "worker_robust.py", n=2, devices=1, timeout=90, out=tmp_path, args=("--mode", "alltoall")
    ).check()
    for rank in range(2):
        res = run.results[rank]
        for name, shape in (("one-row", "(1, 2)"), ("rows-of-one", "(4, 1)")):
            msg = res[f"trace-{name}"]
            assert isinstance(msg, str) and msg.startswith("ERROR: ValueError"), (name, msg)
            assert "leading axis" in msg and "size 2" in msg and shape in msg, msg
        msg = res["target"]
        assert isinstance(msg, str) and "INVALID_ARGUMENT" in msg, msg
        assert "leading axis" in msg and "size 2" in msg and "(1, 2)" in msg, msg
        right = _ok(run, rank, "right")
        _bitwise(right["got"], right["want"], f"rank {rank} right shape")


# --------------------------------------------------------------------------
# E: the agreement's lock is per communicator.


def test_agreements_of_concurrent_programs_on_two_communicators(tmp_path):
    run = run_mpi(
        "worker_robust.py", n=2, devices=1, timeout=90, out=tmp_path, args=("--mode", "concurrent")
    )
    assert not run.timed_out, "deadlock:\n" + run.describe()
    run.check()
    for rank in range(2):
        res = run.results[rank]
        assert res["done"] == [0, 1], run.describe()
        for k in (0, 1):
            _bitwise(res["outs"][k], res["want"][k], f"rank {rank} program {k}")


# --------------------------------------------------------------------------
# A and D: a stall ends the job with on_timeout="abort"; the first execution
# (compile, agreement, first call) is watched too.

STALL_T = 3.0  # the watchdog's timeout in these jobs
BOUND_S = STALL_T + 30  # a stalled job must end within this (plus start-up)


def _stall(tmp_path, *, on_timeout, stall_step, sleep, timeout=150, steps=3, **options):
    args = ["--timeout", STALL_T, "--on-timeout", on_timeout, "--stall-step", stall_step]
    args += ["--sleep", sleep, "--steps", steps]
    for k, v in options.items():
        args += [f"--{k.replace('_', '-')}", v]
    return run_mpi("worker_stall.py", n=2, devices=2, timeout=timeout, out=tmp_path, args=args)


def _stall_started(tmp_path, stall_step):
    """When rank 0 started the step that rank 1 stalls before (a marker file)."""
    return float((tmp_path / f"rank0.step{stall_step}").read_text())


@pytest.mark.parametrize(
    "stall_step, options",
    [(0, {}), (1, {}), (0, dict(staging="host", strategy="two_dimensional"))],
    ids=["first-step", "later-step", "first-step-host-two_dimensional"],
)
def test_stall_reported_and_waited_out(tmp_path, stall_step, options):
    """on_timeout="report": rank 0 names rank 1, the synchronisation and the
    step, and keeps waiting; when rank 1 arrives every result is exact. On the
    first step rank 0 waits in the agreement (it said nothing before)."""
    run = _stall(tmp_path, on_timeout="report", stall_step=stall_step, sleep=3 * STALL_T, **options)
    run.check()
    for rank in range(2):
        for out in run.results[rank]["outs"]:
            _bitwise(out, np.full(5, 1.5, np.float32), f"rank {rank}")
    reports = run.results[0]["reports"]
    assert len(reports) == 1, reports
    msg = reports[0]
    assert "jaxsync watchdog: rank 0 has waited" in msg, msg
    name = f"{options.get('strategy', 'hierarchical')}_mean #1"
    assert f"synchronisation {name}, step {stall_step + 1} " in msg, msg
    assert "ranks not arrived: 1" in msg, msg
    assert run.results[1]["reports"] == []  # rank 1 never waited


@pytest.mark.parametrize("stall_step", [0, 1], ids=["first-step", "later-step"])
def test_stall_aborts_the_job(tmp_path, stall_step):
    """on_timeout="abort": rank 1 never comes (it sleeps in Python); both ranks
    print the diagnosis once and the job ends non-zero, well before rank 1
    would wake up."""
    run = _stall(tmp_path, on_timeout="abort", stall_step=stall_step, sleep=600)
    assert not run.timed_out, "the stalled job did not end:\n" + run.describe()
    assert run.returncode != 0, run.describe()
    assert all(r is None for r in run.results), "a rank finished:\n" + run.describe()
    import time

    waited = time.time() - _stall_started(tmp_path, stall_step)
    assert waited < BOUND_S, f"ended {waited:.0f} s after the stall:\n{run.describe()}"
    lines = [ln for ln in run.output.splitlines() if "jaxsync watchdog" in ln]
    step = f"synchronisation hierarchical_mean #1, step {stall_step + 1} "
    mine = [ln for ln in lines if ln.startswith("jaxsync watchdog: rank 0 has waited")]
    theirs = [ln for ln in lines if ln.startswith("jaxsync watchdog: rank 1 ends the job")]
    assert len(mine) == 1 and len(theirs) == 1, run.describe()
    for ln in mine + theirs:
        assert step in ln and "ranks not arrived: 1" in ln and "on_timeout='abort'" in ln, ln


@pytest.mark.parametrize("how", ["stop", "die"])
def test_stall_aborts_without_the_peer(tmp_path, how):
    """on_timeout="abort" with a peer that never answers (stopped: alive but
    silent, as behind a cut link) or is killed: the job ends non-zero; for
    the silent peer the watchdog names it as not answering."""
    run = _stall(tmp_path, on_timeout="abort", stall_step=1, sleep=600, how=how)
    assert not run.timed_out, "the job did not end:\n" + run.describe()
    assert run.returncode != 0, run.describe()
    import time

    waited = time.time() - _stall_started(tmp_path, 1)
    assert waited < BOUND_S, f"ended {waited:.0f} s after the stall:\n{run.describe()}"
    if how == "stop":
        mine = [ln for ln in run.output.splitlines() if ln.startswith("jaxsync watchdog: rank 0")]
        assert len(mine) == 1, run.describe()
        assert "ranks not answering" in mine[0] and ": 1;" in mine[0], mine[0]
        assert "step 2 " in mine[0] and "on_timeout='abort'" in mine[0], mine[0]

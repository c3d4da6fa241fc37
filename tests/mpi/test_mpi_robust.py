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

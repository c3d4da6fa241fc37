"""Uneven inputs under ``mpirun -n 2`` with 2 devices each (``worker_join.py``).

The replicas have different batch counts (rank 1's run out first); every case
(a blocking chain, ``weights="world"``, overlap with many buckets, double
buffering, ``sharded``) ends at the same step on every rank with parameters
equal bit for bit to the closed-form SGD run. A rank that stops without
joining is reported by the stall watchdog (``timeout=``), and the run ends
once it comes back. With ``early_termination="raise"`` (``worker_join_raise.py``)
both ranks raise at the step where one runs out.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi_harness import requires_mpi, run_mpi
from worker_join import BATCHES, LR

pytestmark = requires_mpi


@pytest.fixture(scope="module")
def run():
    return run_mpi("worker_join.py", n=2, devices=2, timeout=240, args=("--watchdog", 220)).check()


def _closed_form(n, world=False):
    batches = np.array(BATCHES[:n])
    q = np.arange(n, dtype=np.float32)
    p = np.float32(0)
    for t in range(batches.max()):
        have = t < batches
        num = np.sum(np.where(have, (t + 1) * (q + 1) / 4 * (q + 1), 0), dtype=np.float32)
        den = np.float32(n) if world else np.sum(np.where(have, q + 1, 0), dtype=np.float32)
        p = np.float32(p - np.float32(LR) * (num / den))
    return p


@pytest.mark.parametrize("case", ["chain", "world", "overlap", "double_buffering", "sharded"])
def test_uneven_batches_end_together_at_the_closed_form(run, case):
    meta = run.results[0]["meta"]
    n = meta["size"] * meta["devices"]
    want = _closed_form(n, world=case == "world")
    steps = max(BATCHES[:n]) + (case == "double_buffering")  # learns one step later
    for rank in range(meta["size"]):
        got = run.results[rank][case]
        if isinstance(got, str):
            pytest.fail(f"rank {rank} {case}: {got}", pytrace=False)
        params, t = got
        assert t == steps, (rank, case, t)
        for k, v in params.items():
            assert v.dtype == np.float32 and (v.view(np.uint32) == want.view(np.uint32)).all(), (
                rank, case, k, v, want,
            )  # fmt: skip


def test_a_rank_that_stops_without_joining_is_reported(run):
    meta = run.results[0]["meta"]
    params, _ = run.results[0]["stall"]
    assert (params["a"] == _closed_form(meta["size"] * meta["devices"])).all()
    reports = run.results[0]["reports"]
    assert len(reports) >= 1, reports
    assert "jaxsync watchdog: rank 0 has waited" in reports[0], reports[0]
    assert "ranks not arrived: 1" in reports[0], reports[0]
    assert run.results[1]["reports"] == []


def test_early_termination_raise_stops_every_rank():
    """``early_termination="raise"``: rank 1 runs out after its first batch and
    both ranks raise at that step with the same explanation (no rank hangs)."""
    run = run_mpi("worker_join_raise.py", n=2, devices=1, timeout=120, args=("--watchdog", 100))
    assert run.returncode == 0 and all(run.results), run.describe()
    for r in range(2):
        msg, t = run.results[r]["raise"]
        assert t == 0, (r, msg)
        assert "early termination: 1 of 2 replicas passed done=True" in msg, (r, msg)

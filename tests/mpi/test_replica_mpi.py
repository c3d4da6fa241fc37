"""replica_mean across processes (worker_replica.py): exact BatchNorm-like statistics.

Two processes with two devices each (jaxsync requires the same device count on
every process: the agreement check refuses uneven counts).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi_harness import requires_mpi, run_mpi

pytestmark = requires_mpi

ROWS, COLS = 4, 3


@pytest.fixture(scope="module")
def replica_run():
    return run_mpi("worker_replica.py", n=2, devices=2, timeout=120).check()


def _expected(counts):
    base = np.arange(ROWS * COLS, dtype=np.float64).reshape(ROWS, COLS)
    per = [base + 16 * g for g in range(sum(counts))]
    return {
        "mean": np.mean([b.mean(0) for b in per], 0),
        "var": np.mean([b.var(0) for b in per], 0),
        "loss": np.mean([b.sum() / 16 for b in per]),
    }


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def _check(got, want, what):
    for k in want:
        # vmap/pmap results carry a leading replica axis: every row must match
        g = np.asarray(got[k])
        rows = g.reshape((-1,) + np.shape(want[k])) if g.shape != np.shape(want[k]) else g[None]
        for row in rows:
            np.testing.assert_array_equal(_bits(row), _bits(want[k]), err_msg=f"{what} {k}")


@pytest.mark.parametrize("case", ["shard_map", "shard_map-invariant", "vmap", "pmap"])
def test_statistics_averaged_exactly_over_devices_and_processes(replica_run, case):
    counts = replica_run.results[0]["meta"]["counts"]
    want = _expected(counts)
    for rank, res in enumerate(replica_run.results):
        assert res["meta"]["counts"] == counts
        _check(res[case], want, f"rank {rank} {case}")


def test_sync_gradients_divides_invariant_stats_again(replica_run):
    """The contrast (issue 26): sync_gradients reads the pmean'd statistics as a sum
    autodiff took, so it gives replica_mean's value divided by the local device
    count."""
    counts = replica_run.results[0]["meta"]["counts"]
    want = _expected(counts)
    for res in replica_run.results:
        for k in want:
            np.testing.assert_array_equal(
                np.asarray(res["shard_map-invariant-sync_gradients"][k]),
                np.float32(want[k]) / np.float32(counts[0]),
            )


def test_local_batch_gives_each_rank_its_rows(replica_run):
    """jaxsync.local_batch under mpirun -n 2 x 2 devices: rank r the rows
    [8 r, 8 r + 8) of a global batch of 16, 4 a device in order; 6 rows raise."""
    x = np.arange(32.0).reshape(16, 2)
    for rank in range(2):
        shards = replica_run.results[rank]["local_batch"]
        want = [x[8 * rank + 4 * d : 8 * rank + 4 * d + 4] for d in range(2)]
        assert len(shards) == 2 and all(np.array_equal(s, w) for s, w in zip(shards, want))
        msg = replica_run.results[rank]["local_batch_uneven"]
        assert msg and "6 rows" in msg and "2 processes x 2 devices" in msg, msg

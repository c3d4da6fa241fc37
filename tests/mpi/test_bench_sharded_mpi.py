"""``python -m jaxsync bench --suite sharded --quick`` under ``mpirun -n 2`` (one
device each): the docs' step with ``sharded`` and the chain over MPI, the bare
mpi4py collectives, and sharded-shm.json with the state's bytes per device
those of one replica's slices (N = 2). Speed is not asserted."""

import json
import math

from mpi_harness import requires_mpi, run_bench

pytestmark = requires_mpi


def test_sharded_suite_under_mpirun(tmp_path):
    args = ["--suite", "sharded", "--quick", "--trees", "tiny", "--rounds", "1", "--iters", "1"]
    returncode, text, timed_out = run_bench([*args, "--out", tmp_path], timeout=300)
    if timed_out:
        raise AssertionError("sharded bench under mpirun timed out:\n" + text[-3000:])
    assert returncode == 0, text[-3000:]
    result = json.loads((tmp_path / "sharded-shm.json").read_text())
    assert (result["meta"]["processes"], result["meta"]["devices"]) == (2, 1)
    (row,) = result["rows"]
    assert row["replicas"] == 2 and row["state_bytes"] == row["expected_bytes"]
    assert row["state_bytes"]["sharded"] == 2 * 4 * row["params"] // 2 + 4
    assert all(math.isfinite(v) and v > 0 for v in row["median_ms"].values()), row
    # The donated step copies no parameter and no state, sharded or chained (the
    # loss's replica_mean once came after the update: XLA:CPU then read the
    # parameters for the loss after updating them, and copied every one first).
    assert row["hlo_ops"]["chain"]["copy"] == row["hlo_ops"]["sharded"]["copy"] == 0, row

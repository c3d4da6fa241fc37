"""Row-sparse sync over jax.distributed (gloo on CPU), comm=AxisComm("host"):
two real processes x 2 devices, exact by construction."""

from pathlib import Path

import numpy as np
import pytest
from _launch import run_workers

WORKER = Path(__file__).with_name("worker_sparse_axis.py")


@pytest.fixture(scope="module")
def results():
    return run_workers(WORKER)


@pytest.mark.parametrize("case", ["sparse", "coalesce", "densify"])
def test_sparse_axis_comm_across_real_processes_is_exact(results, case):
    # Replica r (0..3) adds 2*(r+1) to row r and r+1 to row r+1; mean over 4.
    want = np.zeros((64, 2))
    for r in range(4):
        want[r] += 2 * (r + 1)
        want[r + 1] += r + 1
    want /= 4
    rows = [x for x in results if x["case"] == case]
    assert sorted(x["pid"] for x in rows) == [0, 1]
    for x in rows:
        assert np.array_equal(np.array(x["dense"], np.float32), want.astype(np.float32))
        assert x["w"] == [1.5, 1.5]

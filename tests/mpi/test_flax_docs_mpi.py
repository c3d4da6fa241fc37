"""docs/flax.md under ``mpirun -n 2`` with 2 devices per process (worker_flax_docs.py).

The page's code is one training script; run on two processes it must give every
rank the same metrics, its own rank from ``jaxsync.topology()``, and the counts of
synchronisations the page states.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi_harness import requires_mpi, run_mpi

pytestmark = requires_mpi


@pytest.fixture(scope="module")
def page_run():
    return run_mpi("worker_flax_docs.py", n=2, devices=2, timeout=400).check()


def test_the_page_runs_on_two_processes_alike(page_run):
    r0, r1 = page_run.results
    assert [r["rank_size"] for r in (r0, r1)] == [(0, 2), (1, 2)]
    assert r0["devices"] == r1["devices"] == 2
    for k in r0["metrics"]:  # averaged over every replica: the same bits on every rank
        np.testing.assert_array_equal(r0["metrics"][k], r1["metrics"][k], err_msg=k)
    assert r0["loss"] == r1["loss"] and r0["test_accuracy"] == r1["test_accuracy"]
    assert r0["test_accuracy"] > 0.9
    assert r0["calls"] == r1["calls"] == 2 * 2  # the scan: 2 steps x 2 devices

"""docs/equinox.md and docs/checkpoints.md under ``mpirun -n 2`` with 2 devices per
process (worker_docs_page.py): each page is one script, as the pages say to run them.

The equinox page's checks (its data-parallel run matches one device over the whole
batches; the replicas are bit-identical, across the processes too) run on each rank;
here every rank must also report the same metrics and the same parameters, and its
own rank. The checkpoints page saves and restores into per-rank directories.
"""

from __future__ import annotations

import numpy as np
from mpi_harness import requires_mpi, run_mpi

pytestmark = requires_mpi


def _page(page, record):
    args = ("--page", page, "--record", ",".join(record))
    return run_mpi("worker_docs_page.py", n=2, devices=2, args=args, timeout=400).check()


def test_the_equinox_page_runs_on_two_processes_alike():
    record = ("RANK", "SIZE", "metrics", "host_params", "diff", "moved", "processes_agree")
    r0, r1 = _page("docs/equinox.md", record).results
    assert [(r["RANK"], r["SIZE"], r["devices"]) for r in (r0, r1)] == [
        ([0], [2], 2),
        ([1], [2], 2),
    ]
    assert r0["processes_agree"] == r1["processes_agree"] == [True]
    for k in ("metrics", "host_params", "diff", "moved"):  # the same bits on every rank
        assert len(r0[k]) == len(r1[k]) > 0, k
        for a, b in zip(r0[k], r1[k]):
            np.testing.assert_array_equal(a, b, err_msg=k)
    assert 0 < r0["diff"][0] < 1e-4 * r0["moved"][0]  # rounding, not equality


def test_the_checkpoints_page_runs_on_two_processes():
    # The page asserts on every rank: its state restored bit for bit, the same next step.
    r0, r1 = _page("docs/checkpoints.md", ("RANK",)).results
    assert (r0["RANK"], r1["RANK"]) == ([0], [1])
    assert r0["devices"] == r1["devices"] == 2

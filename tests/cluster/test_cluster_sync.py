"""jaxsync across the emulated cluster's hosts: exact strategies, faults, process death.

The exact cases are the MPI suite's (``tests/mpi/worker_exact.py``: replica
``r`` holds ``r + k`` in leaf ``k``, the mean has a closed form), here with the
ranks spread over 2 hosts whose links are shaped, so the inter-host stage runs
over TCP between network namespaces.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from cluster_harness import HERE, MPI_DIR, worker_env

import jaxsync

PY = __import__("sys").executable
STRATEGIES = ("naive", "flat", "hierarchical", "two_dimensional")
CASES = [f"shard_map-{s}-mean" for s in STRATEGIES] + [
    f"shard_map-{s}-mean-comm_bf16" for s in STRATEGIES
]


def results(out, n):
    return [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(n)]


@pytest.mark.parametrize("devices", [1, 2])
def test_every_strategy_is_exact_on_2_hosts_x_2_processes(cluster, tmp_path, devices):
    from test_mpi import assert_bitwise, stacked_expected

    cmd = [PY, MPI_DIR / "worker_exact.py", "--out", tmp_path, "--devices", devices]
    r = cluster.run(
        [*cmd, "--cases", ",".join(CASES)],
        hosts=2,
        procs_per_host=2,
        env=worker_env(),
        timeout=240,
    )
    assert r.returncode == 0, r.output
    want = stacked_expected(4 * devices, devices, "mean")
    for rank, res in enumerate(results(tmp_path, 4)):
        assert res["meta"] == dict(rank=rank, size=4, devices=devices)
        for case in CASES:
            got = res[case]
            assert not isinstance(got, str), f"rank {rank} {case}: {got}"
            assert_bitwise(got, want, f"rank {rank} {case}")


def _train(cluster, out, faults=(), **kw):
    out.mkdir()
    cmd = [PY, HERE / "worker_fault_train.py", "--out", out, "--start", "9", "--steps", "12"]
    r = cluster.run(cmd, hosts=2, procs_per_host=1, link_down=faults, env=worker_env(), **kw)
    return r, (results(out, 2) if r.returncode == 0 else None)


def test_a_link_down_for_2_s_mid_training_is_survived_with_the_same_parameters(cluster, tmp_path):
    fault = jaxsync.cluster.LinkDown(host=1, at=10.0, duration=2.0)
    r, got = _train(cluster, tmp_path / "fault", [fault], timeout=150)
    assert r.returncode == 0, r.output
    assert "host1's link down for 2 s" in r.output and "host1's link up" in r.output
    for res in got:
        assert res["began"] < fault.at, f"training began after the fault ({res['began']:.1f} s)"
        assert res["ended"] > fault.at + fault.duration, res["ended"]
        assert res["longest_step"] > 1.0, "no step waited for the link"  # it was hit
    r0, clean = _train(cluster, tmp_path / "clean", timeout=150)
    assert r0.returncode == 0, r0.output
    for res, ref in zip(got, clean):
        for k in ref["params"]:
            assert np.asarray(res["params"][k]).tobytes() == np.asarray(ref["params"][k]).tobytes()


def test_a_process_that_dies_mid_step_ends_the_job(cluster, tmp_path):
    cmd = [PY, MPI_DIR / "worker_death.py", "--out", tmp_path, "--devices", "1"]
    r = cluster.run(
        [*cmd, "--mode", "die_after_compile"],
        hosts=2,
        procs_per_host=1,
        env=worker_env(),
        timeout=120,
    )
    assert not r.timed_out, "the job hung after rank 1 died:\n" + r.output
    assert r.returncode != 0, r.output
    assert (tmp_path / "rank0.calling").exists(), r.output
    assert not (tmp_path / "rank0.returned").exists(), r.output


def test_selftest_on_2_hosts_x_2_processes(cluster):
    cmd = [PY, "-m", "jaxsync", "selftest", "--mbytes", "2", "--iters", "2"]
    r = cluster.run(cmd, hosts=2, procs_per_host=2, devices=1, env=worker_env(), timeout=240)
    assert r.returncode == 0, r.output
    assert "[host0 r0] selftest passed" in r.output
    assert "topology: 2 host(s), 4 process(es), 1 device(s) each" in r.output
    assert "hosts, one process each (MPI, network)" in r.output

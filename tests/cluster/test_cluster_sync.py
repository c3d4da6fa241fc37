"""jaxsync across the emulated cluster's hosts: exact strategies, faults, process death.

The exact cases are the MPI suite's (``tests/mpi/worker_exact.py``: replica
``r`` holds ``r + k`` in leaf ``k``, the mean has a closed form), here with the
ranks spread over 2 hosts whose links are shaped, so the inter-host stage runs
over TCP between network namespaces, and with 2 or 3 processes on each host,
so the host tier (processes of a host over shared memory first) is in use.
"""

from __future__ import annotations

import pickle
import re

import numpy as np
import pytest
from cluster_harness import HERE, MPI_DIR, worker_env

import jaxsync

PY = __import__("sys").executable
STRATEGIES = ("naive", "flat", "hierarchical", "two_dimensional")


def results(out, n):
    return [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(n)]


TIER_CALLS = {  # the host tier's native targets each strategy calls
    "naive": set(),
    "flat": {"jaxsync_reduce", "jaxsync_bcast"},
    "hierarchical": {"jaxsync_reduce", "jaxsync_bcast"},
    "two_dimensional": {"jaxsync_reduce_scatter"},
}


@pytest.mark.parametrize(
    "procs,devices,tier", [(2, 1, True), (2, 2, True), (3, 1, True), (3, 2, True), (2, 1, False)]
)
def test_every_strategy_is_exact_on_2_hosts(cluster, tmp_path, procs, devices, tier):
    """Every replica bit for bit the closed form, with the host tier (several
    processes on each host) and without it. 3 processes: N = 6 or 12 replicas,
    where float16's mean (always divided first) is not exact by construction:
    sums only."""
    from test_mpi import TIER_TARGETS, assert_bitwise, stacked_expected

    reduces = ("mean", "sum") if procs == 2 else ("sum",)
    cases = [
        f"shard_map-{s}-{r}{v}" for s in STRATEGIES for r in reduces for v in ("", "-comm_bf16")
    ]
    cmd = [PY, MPI_DIR / "worker_exact.py", "--out", tmp_path, "--devices", devices]
    r = cluster.run(
        [*cmd, "--cases", ",".join(cases)],
        hosts=2,
        procs_per_host=procs,
        env=worker_env(host_tier=tier),
        timeout=360,
    )
    assert r.returncode == 0, r.output
    n = 2 * procs
    for rank, res in enumerate(results(tmp_path, n)):
        assert res["meta"] == dict(rank=rank, size=n, devices=devices)
        for case in cases:
            got = res[case]
            assert not isinstance(got, str), f"rank {rank} {case}: {got}"
            want = stacked_expected(n * devices, devices, case.split("-")[2])
            assert_bitwise(got, want, f"rank {rank} {case}")
            calls = {t for t, _ in res["calls:" + case]}
            want_calls = TIER_CALLS[case.split("-")[1]] if tier else set()
            assert calls & TIER_TARGETS == want_calls, (case, calls)


def test_the_host_tier_changes_the_lowered_step_across_hosts(cluster, tmp_path):
    """The other half of tests/mpi's one-host test: across hosts with several
    processes on each, the tier is what makes the step differ."""
    from test_mpi import TIER_TARGETS

    cmd = [PY, MPI_DIR / "worker_tier_lowering.py", "--out", tmp_path, "--devices", "1"]
    r = cluster.run(cmd, hosts=2, procs_per_host=2, env=worker_env(), timeout=180)
    assert r.returncode == 0, r.output
    for rank, res in enumerate(results(tmp_path, 4)):
        assert res["topology"]["hosts"] == 2 and res["topology"]["local_size"] == 2
        for strategy, want in TIER_CALLS.items():
            for key in (strategy, f"{strategy}-bf16"):
                assert res[f"{key}:same"] == (not want), f"rank {rank} {key}"
                assert set(res[f"{key}:calls"]) & TIER_TARGETS == want, res[f"{key}:calls"]


def test_the_host_tier_rounds_16_bit_sums_once_per_host_and_once_across(cluster, tmp_path):
    """What changes with the tier (tests/mpi/worker_tier_rounding.py): bfloat16
    on the wire, the ranks hold 256, 1 | 1, 1. One rounding of the whole sum
    (naive, no tier): bf16(259) = 260. The tier rounds each host's float32 sum
    before it crosses, then the hosts' sum: bf16(bf16(257) + bf16(2)) = 258."""
    cmd = [PY, MPI_DIR / "worker_tier_rounding.py", "--out", tmp_path, "--devices", "1"]
    r = cluster.run(cmd, hosts=2, procs_per_host=2, env=worker_env(), timeout=180)
    assert r.returncode == 0, r.output
    for rank, res in enumerate(results(tmp_path, 4)):
        assert res["naive"] == 260.0, (rank, res)
        for strategy in ("flat", "hierarchical", "two_dimensional"):
            assert res[strategy] == 258.0, (rank, strategy, res)


def _train(cluster, out, faults=(), **kw):
    out.mkdir()
    cmd = [PY, HERE / "worker_fault_train.py", "--out", out, "--steps", "12"]
    for f in faults:  # the fault's host meets it at its step (see the worker)
        cmd += ["--fault-host", f.host, "--fault-step", f.after.removeprefix("step-")]
    r = cluster.run(cmd, hosts=2, procs_per_host=1, link_down=faults, env=worker_env(), **kw)
    return r, (results(out, 2) if r.returncode == 0 else None)


def _fault_times(output: str, host: int) -> tuple[float, float]:
    """When the cluster took ``host``'s link down and brought it up (its clock)."""
    down = re.search(rf"\[cluster\] t=([\d.]+) s: host{host}'s link down", output)
    up = re.search(rf"\[cluster\] t=([\d.]+) s: host{host}'s link up", output)
    assert down and up, output
    return float(down.group(1)), float(up.group(1))


def test_a_link_down_for_2_s_mid_training_is_survived_with_the_same_parameters(cluster, tmp_path):
    # At the training's step 3 (a marker), not at a time: the start-up's length
    # depends on the machine's load (a fault at 10 s once came before training).
    fault = jaxsync.cluster.LinkDown(host=1, after="step-3", duration=2.0)
    r, got = _train(cluster, tmp_path / "fault", [fault], timeout=150)
    assert r.returncode == 0, r.output
    assert "host1's link down for 2 s (0 s after marker 'step-3')" in r.output, r.output
    down, up = _fault_times(r.output, 1)
    for res in got:
        assert res["began"] < down, f"training began after the fault ({res['began']:.2f} s)"
        assert res["ended"] > up, res["ended"]
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

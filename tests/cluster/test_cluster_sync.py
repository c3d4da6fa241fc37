"""jaxsync across the emulated cluster's hosts: exact strategies, faults, process death.

The exact cases are the MPI suite's (``tests/mpi/worker_exact.py``: replica
``r`` holds ``r + k`` in leaf ``k``, the mean has a closed form), here with the
ranks spread over 2 hosts whose links are shaped, so the inter-host stage runs
over TCP between network namespaces, and with 2 or 3 processes on each host,
so the host tier (processes of a host over shared memory first) can be used:
by default for syncs mostly 16-bit on the wire (``host_tier="auto"``).
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


def _exact_cases(procs: int) -> list:
    """Every strategy with float32 and bfloat16 on the wire (mean and sum; 3
    processes: N = 6 or 12 replicas, where float16's mean, always divided
    first, is not exact by construction: sums only), and for the tiered
    strategies the tree's own dtypes and the option against the default."""
    reduces = ("mean", "sum") if procs == 2 else ("sum",)
    wires = ("-comm_f32", "-comm_bf16")
    cases = [f"shard_map-{s}-{r}{w}" for s in STRATEGIES for r in reduces for w in wires]
    extra = ("", "-comm_f32-tier_on", "-comm_bf16-tier_off")
    return cases + [f"shard_map-{s}-{reduces[0]}{v}" for s in STRATEGIES[1:] for v in extra]


def _takes_tier(case: str, env) -> bool:
    """Whether ``case`` takes the host tier (2 hosts, several processes on each):
    the environment's override, else the option, else (``"auto"``) whether
    most of the bytes on the wire are 16-bit."""
    from mpi_data import LEAVES

    strategy, opts = case.split("-")[1], case.split("-")[3:]
    if strategy == "naive" or env is False:
        return False
    if "tier_on" in opts or "tier_off" in opts:
        return "tier_on" in opts
    if opts:
        return opts == ["comm_bf16"]
    nbytes = [int(np.prod(shape)) * np.dtype(d).itemsize for _, shape, d in LEAVES]
    sixteen = [n for n, (_, _, d) in zip(nbytes, LEAVES) if d in ("float16", "bfloat16")]
    return 2 * sum(sixteen) > sum(nbytes)  # 48 of 92 bytes: the tier


def _run_worker(
    cluster, worker, out, *args, devices=1, procs_per_host=2, host_tier=True, timeout=180
):
    """``tests/mpi/WORKER --out OUT --devices DEVICES ARGS`` on 2 hosts of
    ``procs_per_host`` processes; ``host_tier`` as :func:`worker_env` takes it."""
    cmd = [PY, MPI_DIR / worker, "--out", out, "--devices", devices, *args]
    env = worker_env(host_tier=host_tier)
    return cluster.run(cmd, hosts=2, procs_per_host=procs_per_host, env=env, timeout=timeout)


@pytest.mark.parametrize(
    "procs,devices,env", [(2, 1, None), (2, 2, None), (3, 2, None), (2, 1, False)]
)
def test_every_strategy_is_exact_on_2_hosts(cluster, tmp_path, procs, devices, env):
    """Every replica bit for bit the closed form, with the default (no
    ``JAXSYNC_HOST_TIER``: bfloat16 on the wire takes the host tier, float32
    does not), ``host_tier=True``/``False``, and ``JAXSYNC_HOST_TIER=0`` (no
    tier for any transform: the cases that take it by default or by option).
    The lowered step's custom calls say which path each synchronisation took.
    (3 processes of 1 device each, as 3 x 2 but for the intra-process stage,
    left out for the suite's time: 30 s.)"""
    from test_mpi import TIER_TARGETS, assert_bitwise, stacked_expected

    cases = _exact_cases(procs)
    if env is False:
        cases = [c for c in cases if _takes_tier(c, None)]
        assert len(cases) >= 9, cases
    r = _run_worker(
        cluster, "worker_exact.py", tmp_path, "--cases", ",".join(cases),
        devices=devices, procs_per_host=procs, host_tier=env, timeout=480,
    )  # fmt: skip
    assert r.returncode == 0, r.output
    n = 2 * procs
    tiered = [c for c in cases if _takes_tier(c, env)]
    if env is None:  # the default path, per synchronisation
        assert f"shard_map-hierarchical-{'mean' if procs == 2 else 'sum'}-comm_bf16" in tiered
        assert not [c for c in tiered if "comm_f32" in c and "tier_on" not in c], tiered
    for rank, res in enumerate(results(tmp_path, n)):
        assert res["meta"] == dict(rank=rank, size=n, devices=devices)
        for case in cases:
            got = res[case]
            assert not isinstance(got, str), f"rank {rank} {case}: {got}"
            want = stacked_expected(n * devices, devices, case.split("-")[2])
            assert_bitwise(got, want, f"rank {rank} {case}")
            calls = {t for t, _ in res["calls:" + case]}
            want_calls = TIER_CALLS[case.split("-")[1]] if case in tiered else set()
            assert calls & TIER_TARGETS == want_calls, (case, calls)


def test_the_host_tier_changes_the_lowered_step_across_hosts(cluster, tmp_path):
    """The other half of tests/mpi's one-host test: across hosts with several
    processes on each, the tier is what makes the step differ."""
    from test_mpi import TIER_TARGETS

    r = _run_worker(cluster, "worker_tier_lowering.py", tmp_path)
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
    r = _run_worker(cluster, "worker_tier_rounding.py", tmp_path)
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
    r = _run_worker(
        cluster, "worker_death.py", tmp_path, "--mode", "die_after_compile",
        procs_per_host=1, timeout=120,
    )  # fmt: skip
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


def test_sharded_equals_the_chain_on_2_hosts(cluster, tmp_path):
    """jaxsync.sharded on 2 hosts x 2 processes (tests/mpi/worker_zero.py): the
    reduce-scatter and all-gather cross the shaped links; the parameters equal
    the chain's bit for bit, the gathered state is the chain's."""
    from test_zero_mpi import _check_run, _check_states

    r = _run_worker(cluster, "worker_zero.py", tmp_path, "--cases", "sgd,adamw,clip", timeout=480)
    assert r.returncode == 0, r.output
    _check_run(results(tmp_path, 4), {"sgd", "adamw", "clip"})
    _check_states(results(tmp_path, 4))

"""overlap=True and double_buffering=True under ``mpirun -n 2`` and ``-n 3``, and
``overlap="auto"``, the default (``worker_overlap_auto.py``: off within one host,
on across hosts).

Exact, bit for bit (``worker_overlap.py`` describes the cases): overlap gives
the blocking sync's bits (one and two synchronisations in one step, many
buckets, parameters and state donated, under jit, shard_map, pmap and vmap);
double buffering is the stale-by-one SGD sequence computed here by hand; a
checkpoint of a double-buffered state resumes the same run; a process exits
cleanly with overlapped calls still in flight. No timing is asserted.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi_harness import requires_mpi, run_mpi

pytestmark = requires_mpi

CONFIGS = [(2, 1), (3, 1), (2, 2)]


@pytest.fixture(scope="module", params=CONFIGS, ids=[f"n{n}-devices{d}" for n, d in CONFIGS])
def run(request):
    n, devices = request.param
    return run_mpi("worker_overlap.py", n=n, devices=devices, timeout=480).check()


def _got(run, rank, key):
    got = run.results[rank].get(key, "MISSING: the worker did not record this case")
    if isinstance(got, str):
        pytest.fail(f"rank {rank} case {key}:\n{got}", pytrace=False)
    return got


def _modes(run):
    return ["jit"] if run.results[0]["meta"]["devices"] == 1 else ["shard_map", "pmap", "vmap"]


def _bits(tree):
    import jax

    return [np.asarray(a).view(np.uint8).tobytes() for a in jax.tree.leaves(tree)]


def test_overlap_gives_the_blocking_bits(run):
    for mode in _modes(run):
        for rank in range(run.results[0]["meta"]["size"]):
            want = _got(run, rank, f"same:{mode}:blocking")
            got = _got(run, rank, f"same:{mode}:overlap")
            assert len(got) == len(want)
            for s, (a, b) in enumerate(zip(got, want)):
                assert _bits(a) == _bits(b), f"{mode} rank {rank} step {s}"


def test_two_overlapped_syncs_in_one_step_stay_ordered(run):
    size = run.results[0]["meta"]["size"]
    for mode in _modes(run):
        ref = _got(run, 0, f"two:{mode}:blocking")
        for rank in range(size):
            got = _got(run, rank, f"two:{mode}:overlap")
            for s, (a, b) in enumerate(zip(got, ref)):
                assert _bits(a) == _bits(b), f"{mode} rank {rank} step {s}"


def _stale_by_one(n_replicas, steps):
    """Parameters after each step of double-buffered SGD, by hand.

    g_r(w) = 2 w + 6 (r + 1) summed over the N replicas is 2 N w + 3 N (N + 1);
    step t applies (learning rate 1/16) the sum of the gradients taken at step
    t-1's parameters, zeros at t = 0. Everything is dyadic and small: float64
    here is exact, as is float32 there.
    """
    w = [np.arange(6.0) - 2.0, np.arange(4.0) * 2.0]
    prev = None  # the parameters the pending gradients were taken at
    out = []
    n = n_replicas
    for _ in range(steps):
        if prev is None:
            total = [np.zeros_like(a) for a in w]
        else:
            total = [2 * n * a + 3 * n * (n + 1) for a in prev]
        prev = w
        w = [a - total_a / 16 for a, total_a in zip(w, total)]
        out.append([a.astype(np.float32) for a in w])
    return out


@pytest.mark.parametrize("variant", ["double", "double+overlap"])
def test_double_buffering_is_stale_by_one_sgd(run, variant):
    meta = run.results[0]["meta"]
    n = meta["size"] * meta["devices"]
    want = _stale_by_one(n, 6)
    assert not np.array_equal(want[1][0], want[2][0]), "the sequence must move"
    assert np.array_equal(want[0][0], np.arange(6.0) - 2.0)  # the first step: zeros
    for mode in _modes(run):
        for rank in range(meta["size"]):
            got = _got(run, rank, f"{variant}:{mode}")
            for s, (a, b) in enumerate(zip(got, want)):
                assert _bits(a) == _bits(b), (mode, rank, s, a, b)


def test_double_buffering_checkpoint_resumes_bit_identically(run):
    if run.results[0]["meta"]["devices"] != 1:
        pytest.skip("recorded with one device per process")
    for rank in range(run.results[0]["meta"]["size"]):
        straight, resumed = _got(run, rank, "resume")
        assert _bits(straight) == _bits(resumed), f"rank {rank}"


def test_exit_with_overlapped_calls_in_flight():
    got = run_mpi("worker_overlap_exit.py", n=2, devices=1, timeout=180)
    assert not got.timed_out and got.returncode == 0, got.describe()
    assert all(r is not None and r["dispatched"] for r in got.results), got.describe()


@pytest.fixture(scope="module")
def compiled():
    return run_mpi("worker_overlap_hlo.py", n=2, devices=1, timeout=240).check()


@pytest.mark.parametrize("case", ["double", "overlap"])
def test_the_update_waits_for_the_backward_without_copying_parameters(compiled, case):
    # With the sums tied to the backward's gradients (jaxsync_tie, which XLA:CPU
    # keeps where it drops an optimization barrier), the optimizer update comes
    # after the backward that reads the donated parameters: XLA copies none.
    for rank, res in enumerate(compiled.results):
        assert res[f"{case}:params"] == 8, res
        assert "jaxsync_allreduce_async" in res[f"{case}:targets"], res[f"{case}:targets"]
        assert "jaxsync_tie" in res[f"{case}:targets"], res[f"{case}:targets"]
        assert res[f"{case}:copied_params"] == [], f"rank {rank}: {res[f'{case}:copied_params']}"
        # Double buffering's pending gradients go where the donated state was,
        # with one copy in the tie (XLA's copy insertion made two: the state in at
        # the start, the gradients out at the end).
        assert res[f"{case}:state"] == (8 if case == "double" else 0), res
        assert res[f"{case}:copied_state"] == [], f"rank {rank}: {res[f'{case}:copied_state']}"
    a, b = (_bits(r[f"{case}:result"]) for r in compiled.results)
    assert a == b  # the same parameters on both ranks


def test_the_default_is_off_within_one_host_and_on_across_hosts():
    """overlap="auto" (the default): on one host the lowered step is the one
    overlap=False lowers to; with two hosts (faked: the topology's host count) it
    is overlap=True's, and its result has the blocking sync's bits. The same for
    auto_mean (its default was False: blocking across hosts)."""
    got = run_mpi("worker_overlap_auto.py", n=2, devices=1, timeout=300).check()
    for rank, r in enumerate(got.results):
        for f in ("", "auto_mean:"):
            assert r[f"{f}one:hosts"] == 1 and r[f"{f}two:hosts"] == 2, r
            assert r[f"{f}one:same_as_off"] and not r[f"{f}one:same_as_on"], f"rank {rank}: {r}"
            assert "jaxsync_allreduce_async" not in r[f"{f}one:calls"], r[f"{f}one:calls"]
            assert r[f"{f}two:same_as_on"] and not r[f"{f}two:same_as_off"], f"rank {rank}: {r}"
            assert "jaxsync_allreduce_async" in r[f"{f}two:calls"], r[f"{f}two:calls"]
            assert r[f"{f}one:bits_as_blocking"] and r[f"{f}two:bits_as_blocking"], r

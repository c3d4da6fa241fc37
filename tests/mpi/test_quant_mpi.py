"""comm_dtype=jaxsync.Quantized(...) across processes: mpirun -n 2 x 2 devices,
one worker run (tests/mpi/worker_quant.py): the timeline's byte counts against
the formula, the property test's examples (the same on every rank), error
feedback's state equal on every replica; jaxsync.sharded's quantized
reduce-scatter (its bytes, its bound)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from mpi_harness import requires_mpi, run_mpi

pytestmark = requires_mpi

DEVICES = 2


@pytest.fixture(scope="module")
def quant_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("quant")
    return run_mpi(
        "worker_quant.py", n=2, devices=DEVICES, args=("--dir", str(d)), timeout=300
    ).check()


def _calls(path):
    with open(path) as f:
        doc = json.load(f)
    return [
        (e["name"], e["args"]["bytes"])
        for e in doc["traceEvents"]
        if e["ph"] == "X" and e["cat"] == "communication" and e["args"]["bytes"] > 0
    ]


def test_auto_mean_takes_the_quantized_wire(quant_run):
    """auto_mean(comm_dtype=Quantized(...)) (refused before): the strategy it
    picks runs the quantized schedule, so its 3 steps' outputs and residuals are
    one named strategy's, bit for bit (the same choice on every rank)."""
    for r in range(2):
        got = quant_run.results[r]["auto"]
        named = {"hierarchical": quant_run.results[r]["ef"], **got}
        del named["auto"]
        same = [
            k
            for k, v in named.items()
            if all(
                np.array_equal(a.view(np.uint32), b.view(np.uint32))
                for a, b in zip(
                    [*map(np.asarray, got["auto"]["outs"][0]), *got["auto"]["residual"]],
                    [*map(np.asarray, v["outs"][0]), *v["residual"]],
                )
            )
        ]
        assert same, (r, got["auto"], named)


@pytest.mark.parametrize("name", ["int8", "fp4"])
def test_timeline_bytes_match_the_formula(quant_run, name):
    """Per process: the all-to-all sends (N - 1) / N of its buffer, the all-gather
    its slice to N - 1 peers: 2 (N - 1) / N * n * (b / 8 + 4 / B) in all."""
    N = 2
    for rank in range(N):
        w = quant_run.results[rank]["bytes"][name]
        n, b, B = w["n"], w["bits"], w["block"]
        calls = _calls(os.path.join(w["dir"], f"rank{rank}.json"))
        # the leader (local device 0) talks MPI: one all-to-all, one all-gather
        assert sorted(k for k, _ in calls) == ["allgather", "alltoall"], calls
        got = dict(calls)
        assert got["alltoall"] == n * b // 8 + 4 * n // B
        assert got["allgather"] == (n * b // 8 + 4 * n // B) // N
        sent = (N - 1) / N * got["alltoall"] + (N - 1) * got["allgather"]
        assert sent == 2 * (N - 1) / N * n * (b / 8 + 4 / B)
        ratio = sent / (2 * (N - 1) / N * 4 * n)  # float32's ring allreduce
        assert ratio == (b / 8 + 4 / B) / 4  # 0.2539 (int8) / 0.1289 (4 bits) at B=256


def test_property_every_rank_same_examples_within_bound(quant_run):
    rows = [quant_run.results[r]["property"] for r in range(2)]
    assert len(rows[0]) == len(rows[1]) >= 3
    for a, b in zip(*rows):
        assert a["example"] == b["example"] and a["strategy"] == b["strategy"]
        for ya, yb in zip(a["out"], b["out"]):  # every replica of every rank the same bits
            assert (ya.view(np.uint32) == yb[:1].view(np.uint32)).all(), a["example"]
        for row in (a, b):
            assert row["error"] is None, row["error"]


def test_error_feedback_state_equal_everywhere(quant_run):
    ef = [quant_run.results[r]["ef"] for r in range(2)]
    for step in range(3):
        every = np.concatenate([e["outs"][step][0] for e in ef])
        assert (every.view(np.uint32) == every[:1].view(np.uint32)).all()
    for e in ef:  # each process's devices hold its one residual
        r = e["residual"][0]
        assert (r.view(np.uint32) == r[:1].view(np.uint32)).all()
        assert np.abs(r).max() > 0
    assert not np.array_equal(ef[0]["outs"][0][0], ef[0]["outs"][1][0])


@pytest.mark.parametrize("name", ["int8", "fp4"])
def test_sharded_bytes_reduce_scatter_only(quant_run, name):
    """sharded: each replica all-to-alls its processes' rows, N * K values, as
    codes and scales ((N - 1) / N * N K (b / 8 + 4 / B) leave it), and gathers
    its K float32 updates: no requantized all-gather of the gradient."""
    N = 2
    for rank in range(N):
        w = quant_run.results[rank]["sharded"]["bytes"][name]
        K, b, B = w["K"], w["bits"], w["block"]
        calls = _calls(os.path.join(w["dir"], f"rank{rank}.json"))
        # each device of the process: one all-to-all, one all-gather
        assert sorted(k for k, _ in calls) == ["allgather"] * 2 + ["alltoall"] * 2, calls
        n = N * K
        for kind, nbytes in calls:
            if kind == "alltoall":
                assert nbytes == n * b // 8 + 4 * n // B
                assert (N - 1) / N * nbytes == (N - 1) / N * n * (b / 8 + 4 / B)
            else:  # the updates, float32, in their own dtype
                assert nbytes == 4 * K


def test_sharded_within_bound_on_every_rank(quant_run):
    rows = [quant_run.results[r]["sharded"]["rows"] for r in range(2)]
    assert len(rows[0]) == len(rows[1]) == 2
    for a, b in zip(*rows):
        for row in (a, b):
            assert row["error"] is None, row["error"]
        for ya, yb in zip(a["out"], b["out"]):  # the same updates on every rank
            assert (np.asarray(ya).view(np.uint8) == np.asarray(yb).view(np.uint8)).all()


def _bits(tree):
    return [np.asarray(x).view(np.uint8) for x in tree]


@pytest.mark.parametrize("strategy", ["hierarchical", "two_dimensional"])
def test_overlap_runs_the_schedule_per_bucket_on_the_lane_same_bits(quant_run, strategy):
    """overlap=True with a quantized wire (refused before): the schedule runs once
    per overlap bucket, its all-to-all and all-gather on the communicator's lane,
    and three steps of stochastic 4-bit rounding with error feedback give the
    bits of overlap=False (outputs and residuals): the keys fold in each
    bucket's place among the sync's, not its place in the call."""
    for r in range(2):
        got = quant_run.results[r]["overlap"]
        plain, over = got[f"{strategy}/plain"], got[f"{strategy}/overlap"]
        for a, b in zip(plain["outs"], over["outs"]):
            for x, y in zip(_bits(a), _bits(b)):
                np.testing.assert_array_equal(x, y)
        for x, y in zip(_bits(plain["residual"]), _bits(over["residual"])):
            np.testing.assert_array_equal(x, y)
        with open(os.path.join(over["dir"], f"rank{r}.json")) as f:
            events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
        moved = [e for e in events if e["name"] in ("alltoall", "allgather")]
        moved = [e for e in moved if e["args"]["bytes"] > 0]
        # several buckets a step, each an all-to-all then an all-gather, queued
        # on the lane (queued_us: only lane jobs carry it)
        assert len(moved) >= 2 * 2 * 3, len(moved)
        assert all("queued_us" in e["args"] for e in moved), moved[:2]
        with open(os.path.join(plain["dir"], f"rank{r}.json")) as f:
            blocking = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
        blocking = [e for e in blocking if e["name"] in ("alltoall", "allgather")]
        assert not any("queued_us" in e["args"] for e in blocking)
        per_step = sum(e["args"]["bytes"] for e in moved) / 3
        assert per_step == sum(e["args"]["bytes"] for e in blocking) / 3


@pytest.mark.parametrize("strategy", ["hierarchical", "two_dimensional"])
def test_double_buffering_applies_the_last_steps_quantized_mean(quant_run, strategy):
    """double_buffering=True with a quantized wire (refused before): step t
    applies step t - 1's quantized mean, bit for bit the plain transform's, with
    the error feedback carried along (step 1 applies zeros)."""
    for r in range(2):
        got = quant_run.results[r]["overlap"]
        plain, double = got[f"{strategy}/nearest"], got[f"{strategy}/double"]
        for y in double["outs"][0]:
            assert not np.asarray(y).any()
        for a, b in zip(plain["outs"][:2], double["outs"][1:]):
            for x, y in zip(_bits(a), _bits(b)):
                np.testing.assert_array_equal(x, y)


def test_host_tier_with_overlap_and_double_buffering_same_bits():
    """2 hosts x 2 processes (faked): the quantized wire through the host tier
    (float32 on the host, quantized between the leaders), overlapped per bucket
    and by default (overlap="auto" is on across hosts) and double-buffered: the
    same bits as the blocking tier on every rank, outputs and residuals."""
    run = run_mpi("worker_quant_tier.py", n=4, devices=1, timeout=300).check()
    for r in range(4):
        got = run.results[r]["cases"]
        assert {"reduce", "bcast"} <= set(got["plain"]["kinds"]), got["plain"]["kinds"]
        for name in ("overlap", "default"):
            for a, b in zip(got["plain"]["outs"], got[name]["outs"]):
                for x, y in zip(_bits(a), _bits(b)):
                    np.testing.assert_array_equal(x, y, err_msg=name)
            for x, y in zip(_bits(got["plain"]["residual"]), _bits(got[name]["residual"])):
                np.testing.assert_array_equal(x, y, err_msg=name)
        for y in got["double"]["outs"][0]:
            assert not np.asarray(y).any()
        for a, b in zip(got["nearest"]["outs"][:2], got["double"]["outs"][1:]):
            for x, y in zip(_bits(a), _bits(b)):
                np.testing.assert_array_equal(x, y)
    # every rank the same means
    for x, y in zip(
        _bits(run.results[0]["cases"]["plain"]["outs"][2]),
        _bits(run.results[3]["cases"]["plain"]["outs"][2]),
    ):
        np.testing.assert_array_equal(x, y)

"""The benchmark under mpirun (``python -m jaxsync bench``): it runs the README's
shard_map step, the plain-jit path, the bare collectives and a whole train step,
and every sync row really synchronises (it has collectives).

The figures are not checked (the benchmark evaluates its targets itself).
"""

import json

import pytest
from mpi_harness import requires_mpi, run_bench

pytestmark = requires_mpi


def _bench(tmp_path, devices: int):
    out = tmp_path / f"d{devices}"
    args = ["--quick", "--no-sweeps", "--repeats", "1", "--devices", devices, "--out", out]
    returncode, text, timed_out = run_bench(args, timeout=300)
    if timed_out:
        pytest.fail("bench under mpirun timed out:\n" + text[-3000:])
    assert returncode == 0, text[-3000:]
    result = json.loads((out / "mpi.json").read_text())
    assert result["meta"]["processes"] == 2 and result["meta"]["devices"] == devices
    assert result["meta"]["tune_host_allocator"] is False  # glibc defaults, as a user has
    return {r["method"]: r for r in result["rows"]}, result


def _check_syncs(rows, names):
    for name in names:
        r = rows[name]
        # A sync that XLA removed or that never reached MPI would have no collective.
        assert r["ops"] >= 1 and r["arrays"] >= 1 and r["wire_bytes"] > 0, r
        assert len(r["samples_ms"]) == 1
        if r["kind"] == "peer" or (r["kind"] == "jaxsync" and "train step" not in name):
            # Every replica computes the same gradients: their mean is each one's own.
            assert r["correct"] is True, r


def test_bench_one_device_per_process(tmp_path):
    rows, result = _bench(tmp_path, 1)
    strategies = ["naive", "flat", "hierarchical", "two_dimensional", "hierarchical bf16"]
    _check_syncs(
        rows,
        strategies
        + [f"{s} (jit)" for s in strategies]
        + ["hierarchical in a train step", "mpi4jax/leaf", "ravel+mpi4jax", "mpi4jax bare"]
        + ["jax.distributed pmean"],
    )
    assert rows["jax.distributed pmean"]["kind"] == "peer"
    assert rows["mpi4py bare"]["kind"] == "bare"
    assert rows["mpi4py bare in-place"]["kind"] == "limit"
    assert rows["hierarchical in a train step"]["kind"] == "jaxsync"
    names = {t["name"] for t in result["targets"]}
    assert "hierarchical no slower than the mpi4jax loop" in names
    assert "hierarchical no slower than jax.distributed pmean" in names


def test_bench_two_devices_per_process(tmp_path):
    rows, _ = _bench(tmp_path, 2)
    _check_syncs(
        rows,
        [
            "naive",
            "flat",
            "hierarchical",
            "two_dimensional",
            "hierarchical in a train step",
            "psum bare",
            "jax.distributed pmean",  # a global mesh over both processes' 4 devices
        ],
    )
    # mpi4jax's ordered effects refuse multi-device computations: no such rows.
    assert not any("mpi4jax" in m or m.endswith("(jit)") for m in rows)


def test_bench_overlap_suite_smoke(tmp_path):
    """``bench --suite overlap --quick`` under mpirun -n 2: every case timed, the
    targets evaluated, the JSON written (the figures themselves are not checked)."""
    args = ["--suite", "overlap", "--quick", "--out", tmp_path]
    returncode, text, timed_out = run_bench(args, timeout=300)
    if timed_out:
        pytest.fail("bench --suite overlap under mpirun timed out:\n" + text[-3000:])
    assert returncode == 0, text[-3000:]
    record = json.loads((tmp_path / "overlap-shm.json").read_text())
    assert record["meta"]["processes"] == 2 and record["meta"]["hosts"] == 1
    cases = set(record["median_s"])
    assert {"nosync", "blocking", "double", "bare"} <= cases, cases
    assert any(c.startswith("overlap") for c in cases), cases
    assert all(v > 0 for v in record["median_s"].values()), record["median_s"]
    assert record["targets"] and all("ok" in t for t in record["targets"])
    # beside every figure its CPU share (NaN where the calls were too short for a tick)
    assert set(record["cpu_busy"]) == cases, record["cpu_busy"]
    for share in record["cpu_busy"].values():
        assert set(share) == {"machine", "ranks"}
        assert all(not v >= 0 or 0 <= v <= 1.5 for v in share.values()), share
    assert any(share["ranks"] > 0 for share in record["cpu_busy"].values())
    assert "CPU busy" in text
    # one timeline picture beside the JSON, drawn from the ranks' files
    assert (tmp_path / "overlap-shm-timeline.png").stat().st_size > 0
    trace = tmp_path / "overlap-shm-timeline"
    assert {p.name for p in trace.iterdir()} == {"rank0.json", "rank1.json", "timeline.json"}
    assert record["timeline"]["png"] == str(tmp_path / "overlap-shm-timeline.png")
    merged = json.loads((trace / "timeline.json").read_text())
    steps = [e for e in merged["traceEvents"] if e.get("cat") == "step"]
    assert len(steps) == 2 * 3  # TRACE_STEPS per rank


def test_bench_overlap_suite_with_a_quantized_wire(tmp_path):
    """``--wire int8``: every case (overlap and double buffering included, refused
    with a quantized wire before) runs with ``comm_dtype=Quantized(bits=8)``, and
    the bare collective beside them is the schedule's all-to-all and all-gather."""
    args = ["--suite", "overlap", "--quick", "--no-timeline", "--wire", "int8", "--out", tmp_path]
    returncode, text, timed_out = run_bench(args, timeout=300)
    if timed_out:
        pytest.fail("bench --suite overlap --wire int8 timed out:\n" + text[-3000:])
    assert returncode == 0, text[-3000:]
    record = json.loads((tmp_path / "overlap-shm-int8.json").read_text())
    assert record["meta"]["wire"] == "int8" and "wire int8" in text
    assert {"nosync", "blocking", "double", "default", "bare"} <= set(record["median_s"])
    assert all(v > 0 for v in record["median_s"].values()), record["median_s"]

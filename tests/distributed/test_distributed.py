"""jaxsync over jax.distributed (gloo on CPU): two real processes on localhost."""

from pathlib import Path

import pytest
from _launch import run_workers

WORKER = Path(__file__).with_name("worker_axis.py")


@pytest.fixture(scope="module")
def results():
    return run_workers(WORKER)


@pytest.mark.parametrize("strategy", ["naive", "flat", "hierarchical", "two_dimensional"])
def test_axis_comm_across_real_processes_is_exact(results, strategy):
    # 2 processes x 2 devices; replica r holds r (+1 in bf16): mean 1.5 and 2.5 exactly.
    rows = [r for r in results if r["strategy"] == strategy]
    assert len(rows) == 2
    for r in rows:
        assert r["a"] == [1.5] * 5
        assert r["b"] == [2.5] * 3 and r["b_dtype"] == "bfloat16"


def test_broadcast_params_over_jax_distributed(results):
    rows = [r for r in results if r["strategy"] == "broadcast"]
    assert sorted(r["pid"] for r in rows) == [0, 1]
    assert all(r["w"] == [7.0] * 3 for r in rows)


def test_local_batch_over_jax_distributed(results):
    """A global mesh: the global array, each device its 2 rows of 8; a process's
    own mesh: its 4 rows (jax.distributed's process index and count)."""
    rows = sorted((r for r in results if r["strategy"] == "local_batch"), key=lambda r: r["pid"])
    assert [r["pid"] for r in rows] == [0, 1]
    for r in rows:
        p = r["pid"]
        assert r["global_shape"] == [8]
        assert r["global"] == [[4 * p + 2 * d, 4 * p + 2 * d + 1] for d in range(2)]
        assert r["local"] == r["global"]

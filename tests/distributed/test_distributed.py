"""jaxsync over jax.distributed (gloo on CPU): two real processes on localhost."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("worker_axis.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results():
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), port],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=180)
            assert p.returncode == 0, f"worker failed ({p.returncode}):\n{err[-4000:]}"
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    rows = [json.loads(line) for out in outs for line in out.splitlines()
            if line.startswith("{")]
    return rows


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

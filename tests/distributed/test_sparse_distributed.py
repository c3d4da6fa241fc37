"""Row-sparse sync over jax.distributed (gloo on CPU), comm=AxisComm("host"):
two real processes x 2 devices, exact by construction."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

WORKER = Path(__file__).with_name("worker_sparse_axis.py")


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
    return [json.loads(line) for out in outs for line in out.splitlines()
            if line.startswith("{")]


@pytest.mark.parametrize("case", ["sparse", "coalesce", "densify"])
def test_sparse_axis_comm_across_real_processes_is_exact(results, case):
    # Replica r (0..3) adds 2*(r+1) to row r and r+1 to row r+1; mean over 4.
    want = np.zeros((64, 2))
    for r in range(4):
        want[r] += 2 * (r + 1)
        want[r + 1] += r + 1
    want /= 4
    rows = [x for x in results if x["case"] == case]
    assert sorted(x["pid"] for x in rows) == [0, 1]
    for x in rows:
        assert np.array_equal(np.array(x["dense"], np.float32), want.astype(np.float32))
        assert x["w"] == [1.5, 1.5]

"""strategy="auto" under mpirun: the same choice on every rank (rank 0's profile
wins when the ranks' profile files differ), the exact mean, and the agreement
check passing with the choice in the compared text."""

import json
import sys

import numpy as np
import pytest
from mpi_harness import MPIRUN, requires_mpi, run_command, run_mpi

pytestmark = requires_mpi


@pytest.mark.parametrize("devices", [1, 2])
def test_auto_rank0_profile_wins(devices):
    run = run_mpi("worker_auto.py", n=2, devices=devices, timeout=150).check()
    r0, r1 = run.results
    # The two profiles lead to different choices on their own ...
    assert r0["want"][0] != r0["want"][1], r0["want"]
    # ... and both ranks use rank 0's.
    assert r0["got"] == r1["got"] == tuple(r0["want"][0])
    assert "nothing chosen yet" in r0["before"]
    # Same choice and prediction; only the note on the profile's origin differs.
    head = [r["describe"].splitlines()[0].split("; ")[:2] for r in (r0, r1)]
    assert head[0] == head[1], head
    assert f"auto: {r0['got'][0]}" in r0["describe"]
    assert "rank 0's profile" in r1["note"] and "differs" in r1["note"]
    n = r0["replicas"]
    for r in (r0, r1):
        for key in ("result", "sync_gradients"):
            for name, x in r[key].items():
                want = np.full(x.shape, (n + 1) / 2, np.float32)
                np.testing.assert_array_equal(x, want, err_msg=f"{key} {name}")


@pytest.mark.parametrize("devices", [1, 2])
def test_auto_allow_lossy_puts_bfloat16_on_a_slow_wire(devices):
    run = run_mpi("worker_auto_lossy.py", n=2, devices=devices, timeout=150).check()
    r0, r1 = run.results
    for r in (r0, r1):
        head = r["lossy describe"].splitlines()[0]
        assert "comm_dtype bfloat16 (lossy)" in head and "lossy allowed: bfloat16" in head
        plain = r["lossless describe"].splitlines()[0]
        assert "comm_dtype" not in plain and "lossy allowed: none" in plain
    # the same choice on both ranks
    assert [r["lossy describe"].split("; ")[0] for r in (r0, r1)] == [
        r0["lossy describe"].split("; ")[0]
    ] * 2
    n = r0["replicas"]
    for r in (r0, r1):
        for key in ("lossy result", "lossless result"):
            for name, x in r[key].items():
                np.testing.assert_array_equal(x, np.full(x.shape, (n + 1) / 2), err_msg=key + name)


def test_tune_quick_on_one_host_measures_the_shared_memory_link(tmp_path):
    out = tmp_path / "p.json"
    cmd = [MPIRUN, "-n", "2", sys.executable, "-m", "jaxsync", "tune", "--quick"]
    rc, output, timed_out = run_command([*cmd, "--devices", "1", "--out", out], timeout=150)
    assert rc == 0 and not timed_out, output[-3000:]
    from jaxsync.auto._cost import Profile

    prof = Profile.from_json(json.loads(out.read_text()), str(out))
    assert prof.has("host") and not prof.has("network")  # every process on one host
    topo = prof.topology
    assert (topo["processes"], topo["hosts"], topo["per_host"]) == (2, 1, 2)
    assert topo["measured"] == {"host": "2 processes of one host (shared memory)"}

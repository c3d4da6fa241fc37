"""A stalled job ends (``on_timeout="abort"``) inside the emulated cluster.

A host's link cut for good mid-training (at a marker of the training's, not at a
time: how long start-up takes depends on the machine's load), and a rank that
stops calling (stuck in Python): with ``timeout=T, on_timeout="abort"`` the job
ends non-zero within T + 30 s of the fault, and the diagnosis names the rank that
never came. (A link
down for a while, and a rank that dies, are in ``test_cluster_sync.py``.)
"""

from __future__ import annotations

import re
import sys

from cluster_harness import HERE, worker_env

import jaxsync

PY = sys.executable
T = 5.0


def _run(cluster, tmp_path, *extra, faults=()):
    cmd = [PY, HERE / "worker_fault_train.py", "--out", tmp_path, "--steps", "12"]
    cmd += ["--timeout", T, "--on-timeout", "abort", *extra]
    return cluster.run(
        cmd, hosts=2, procs_per_host=1, link_down=faults, env=worker_env(), timeout=150
    )


def _at(pattern: str, output: str) -> float:
    """The cluster-clock time (group 1 of ``pattern``) of the line that matches it."""
    m = re.search(pattern, output)
    assert m, output
    return float(m.group(1))


def test_a_link_cut_for_good_ends_the_job_naming_the_unreachable_rank(cluster, tmp_path):
    # At the training's step 3 (a marker), not at a time: start-up depends on load.
    fault = jaxsync.cluster.LinkDown(host=1, after="step-3")
    r = _run(cluster, tmp_path, "--fault-host", "1", "--fault-step", "3", faults=[fault])
    assert not r.timed_out, r.output
    assert r.returncode != 0, r.output
    assert "host1's link down for good (0 s after marker 'step-3')" in r.output
    diag = [ln for ln in r.output.splitlines() if ln.startswith("[host0 r0] jaxsync watchdog")]
    assert len(diag) == 1, r.output  # once
    assert re.search(r"ranks not (arrived|answering)[^:]*: 1\b", diag[0]), diag[0]
    assert "on_timeout='abort'" in diag[0]
    down = _at(r"\[cluster\] t=([\d.]+) s: host1's link down", r.output)
    assert r.elapsed < down + T + 30 + 15, r.output  # + start-up of the cluster


def test_a_rank_stuck_in_python_ends_the_job_naming_it(cluster, tmp_path):
    r = _run(cluster, tmp_path, "--stall-rank", "1", "--stall-at", "3")
    assert not r.timed_out, r.output
    assert r.returncode != 0, r.output
    assert "[host1 r1] rank 1 stalls" in r.output
    for tag in ("[host0 r0]", "[host1 r1]"):
        lines = [ln for ln in r.output.splitlines() if ln.startswith(f"{tag} jaxsync watchdog")]
        assert len(lines) == 1, r.output  # every process that can speak, once
        assert "ranks not arrived: 1" in lines[0], lines[0]
    stalled = _at(r"\[host1 r1\] rank 1 stalls .* at t=([\d.]+) s", r.output)
    assert r.elapsed < stalled + T + 30 + 15, r.output  # + start-up of the cluster

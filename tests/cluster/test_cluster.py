"""The emulated cluster itself: hosts, output, exit status, links, faults, clean-up.

Every run has a time limit (a hang fails the test). Timing appears only as lower
bounds that a shaped link cannot beat (a busy machine only makes runs slower),
and as generous "no hang" bounds.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_harness import HERE, worker_env

PY = sys.executable


def ranks_json(output: str) -> dict[int, dict]:
    """The JSON line each rank printed, by rank, checking its ``[hostH rR]`` prefix."""
    got = {}
    for line in output.splitlines():
        m = re.match(r"^\[host(\d+) r(\d+)\] (\{.*\})$", line)
        if m:
            d = json.loads(m.group(3))
            assert (int(m.group(1)), int(m.group(2))) == (int(d["env_host"]), d["rank"]), line
            got[d["rank"]] = d
    return got


def namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def left_over(out: Path) -> list[str]:
    """Processes still in a run's PID or network namespaces (the ranks recorded them)."""
    spaces = {ns for f in out.glob("rank*.pid") for ns in f.read_text().split()}
    assert spaces, "no rank recorded its namespaces"
    left = []
    for proc in Path("/proc").iterdir():
        for kind in ("pid", "net") if proc.name.isdigit() else ():
            try:
                if os.readlink(proc / "ns" / kind) in spaces:
                    left.append(f"process {proc.name} in the run's {kind} namespace")
            except OSError:
                pass
    return left


def test_arguments_are_checked_before_anything_is_built():
    import jaxsync.cluster as jc

    with pytest.raises(ValueError, match="link must be a positive rate.*got '1 gigabit'"):
        jc.run(["true"], link="1 gigabit")
    with pytest.raises(ValueError, match="link_down names host 2, but the cluster has hosts 0..1"):
        jc.run(["true"], hosts=2, link_down=[jc.LinkDown(host=2, at=1.0)])
    with pytest.raises(ValueError, match="slow names host 5"):
        jc.run(["true"], hosts=2, slow={5: "10mbit"})
    with pytest.raises(ValueError, match="procs_per_host must be an int >= 1, got 0"):
        jc.run(["true"], procs_per_host=0)
    with pytest.raises(ValueError, match="command must be a non-empty list"):
        jc.run("python train.py")
    with pytest.raises(ValueError, match="HOST@SECONDS"):
        jc.LinkDown.parse("1 at 5")
    with pytest.raises(ValueError, match="duration must be seconds > 0"):
        jc.LinkDown(host=0, at=1.0, duration=0.0)


def test_hosts_ranks_topology_and_exit_status(cluster, tmp_path):
    probe = [PY, HERE / "worker_probe.py", "--out", tmp_path, "--exit-rank", "3", "--code", "7"]
    before = namespaces()
    r = cluster.run(probe, hosts=2, procs_per_host=2, devices=2, env=worker_env(), timeout=120)
    got = ranks_json(r.output)
    assert sorted(got) == [0, 1, 2, 3], r.output
    for rank, d in got.items():
        host = rank // 2
        assert d["hostname"] == f"host{host}", d
        assert (d["host"], d["hosts"], d["local_rank"], d["local_size"]) == (host, 2, rank % 2, 2)
        assert (d["size"], d["devices"]) == (4, 2), d
    assert r.returncode == 7, r.output  # the program's status: rank 3's
    assert not r.timed_out
    assert namespaces() == before
    assert left_over(tmp_path) == []


def test_links_are_shaped_and_a_slow_host_is_slower(cluster):
    link = [PY, HERE / "worker_link.py", "--mbytes", "4"]
    r = cluster.run(link, hosts=2, procs_per_host=2, link="100mbit", timeout=120)
    d = json.loads(r.output.splitlines()[-1].split("] ", 1)[1])
    floor = d["bytes"] * 8 / 100e6  # 0.32 s: no shaped 100 Mb/s link moves it faster
    assert r.returncode == 0, r.output
    assert d["across"] >= 0.9 * floor, d
    assert d["within"] < 0.5 * floor, d  # the processes of one host share memory, not the link
    r = cluster.run(link, hosts=2, procs_per_host=1, link="1gbit", slow={1: "40mbit"}, timeout=120)
    d = json.loads(r.output.splitlines()[-1].split("] ", 1)[1])
    assert r.returncode == 0, r.output
    assert d["across"] >= 0.9 * d["bytes"] * 8 / 40e6, d  # host 1's slower link sets the pace


def _cli(args, out):
    cmd = [PY, "-m", "jaxsync", "cluster", *args, "--", PY, HERE / "worker_probe.py"]
    return subprocess.Popen(
        [str(c) for c in cmd + ["--out", out, "--sleep", "300"]],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=worker_env(),
        start_new_session=True,
    )


def _wait_for_ranks(out: Path, n: int, proc, limit=90):
    deadline = time.monotonic() + limit
    while len(list(out.glob("rank*.pid"))) < n:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.2)
    # Until their output has gone through: a stop must not depend on a later
    # write meeting a closed pipe.
    time.sleep(3)


@pytest.mark.parametrize("how", ["time limit", "ctrl-c", "sigterm", "kill -9"])
def test_nothing_is_left_after_a_run_that_is_stopped(cluster, tmp_path, how):
    before = namespaces()
    args = ["--hosts", "2", "--procs-per-host", "2"]
    if how == "time limit":
        args += ["--timeout", "8"]
    proc = _cli(args, tmp_path)
    _wait_for_ranks(tmp_path, 4, proc)
    assert left_over(tmp_path), "the probe should see the running ranks"
    if how == "ctrl-c":
        os.kill(proc.pid, signal.SIGINT)
    elif how == "sigterm":
        os.kill(proc.pid, signal.SIGTERM)
    elif how == "kill -9":
        os.kill(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    if how == "time limit":
        assert proc.returncode == 124, out
        assert "time limit of 8 s reached" in out
    elif how in ("ctrl-c", "sigterm"):
        assert proc.returncode != 0, out
        assert "[cluster] interrupted" in out, out
    deadline = time.monotonic() + 10  # the kernel reaps a dead PID namespace at once
    while left_over(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left_over(tmp_path) == []
    assert namespaces() == before


def test_run_does_not_fork_a_process_where_jax_runs(cluster):
    """``run`` from a program whose JAX is started (a notebook, the test suite) must
    not fork: JAX warns that fork deadlocks its threads (preexec_fn forked)."""
    code = (
        "import sys, jax, jaxsync.cluster as c; jax.devices(); "
        "r = c.run([sys.executable, '-c', 'print(1)'], hosts=2, timeout=60); "
        "sys.exit(r.returncode)"
    )
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "os.fork() was called" not in r.stderr, r.stderr[-2000:]


def test_a_rank_file_being_written_is_not_a_dead_rank(tmp_path):
    # The supervisor reads rank{R}.pid and rank{R}.exit at any moment: a pid file
    # still empty once read as pid 0, "gone without a status", and the healthy job
    # was ended with status 137 (a full run of the suite, ranks starting slowly).
    from jaxsync.cluster import _inside, _tag

    (tmp_path / "rank0.pid").write_text("")  # created, not yet written
    assert _inside.failed_rank(tmp_path) is None
    _tag._write(str(tmp_path / "rank0.pid"), str(os.getpid()))  # whole or not at all
    assert _inside.failed_rank(tmp_path) is None  # alive
    assert [p.name for p in tmp_path.iterdir()] == ["rank0.pid"]
    dead = subprocess.Popen([PY, "-c", "pass"])
    dead.wait()
    (tmp_path / "rank1.pid").write_text(str(dead.pid))
    assert _inside.failed_rank(tmp_path) == ("rank1", 137)  # gone without a status
    (tmp_path / "rank1.exit").write_text("3")
    assert _inside.failed_rank(tmp_path) == ("rank1", 3)

"""The emulated cluster itself: hosts, output, exit status, links, faults, clean-up.

Every run has a time limit (a hang fails the test). Timing appears only as lower
bounds that a shaped link cannot beat (a busy machine only makes runs slower),
and as generous "no hang" bounds.
"""

from __future__ import annotations

import contextlib
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
    with pytest.raises(ValueError, match="link_down names host 2, but the cluster has hosts 0..1"):
        jc.run(["true"], hosts=2, link_down=[jc.LinkDown(host=2, after="step-3")])


def test_without_a_user_namespace_is_refused_to_a_non_root_user(monkeypatch):
    import jaxsync.cluster as jc
    from jaxsync.cluster import _run

    monkeypatch.setattr(_run.os, "geteuid", lambda: 1000)
    _run._probe.cache_clear()
    try:
        with pytest.raises(
            jc.ClusterUnavailable,
            match=r"user_namespace=False.*needs root.*"
            r"uid 1000\)\. Fix: run as root, or leave the user namespace on",
        ):
            jc.run(["true"], user_namespace=False)
    finally:
        _run._probe.cache_clear()


@pytest.mark.skipif(os.geteuid() != 0, reason="user_namespace=False needs root")
def test_without_a_user_namespace_the_hosts_run_as_the_real_root(cluster):
    """``user_namespace=False``: the same hosts, but the ranks' root is the machine's
    (the identity uid map) instead of a user namespace's, and nothing is left."""
    code = "import socket; print(socket.gethostname(), open('/proc/self/uid_map').read().split())"
    before = namespaces()
    for userns, mapped in (
        (True, f"['0', '{os.getuid()}', '1']"),
        (False, "['0', '0', '4294967295']"),
    ):
        r = cluster.run([PY, "-c", code], hosts=2, timeout=60, user_namespace=userns)
        assert r.returncode == 0, r.output
        lines = sorted(line.split("] ", 1)[1] for line in r.output.splitlines() if "] host" in line)
        assert lines == [f"host0 {mapped}", f"host1 {mapped}"], r.output
    assert namespaces() == before


def test_a_link_down_is_checked_when_it_is_made():
    from jaxsync.cluster import LinkDown

    for bad in ("step 3", "3", "", "-go", "step+3", "a:b", "a" * 65, 3):
        with pytest.raises(
            ValueError, match=r"LinkDown\.after must be a marker name \(a letter, then.*got "
        ) as e:
            LinkDown(host=1, after=bad)
        assert repr(bad) in str(e.value) and "Fix: a name such as 'step-3'" in str(e.value)
    with pytest.raises(
        ValueError, match=r"at must be seconds >= 0 \(after the marker 'go'\), got -1"
    ):
        LinkDown(host=1, after="go", at=-1)
    with pytest.raises(ValueError, match=r"at must be seconds >= 0 \(after the launch\), got '5'"):
        LinkDown(host=1, at="5")
    with pytest.raises(ValueError, match=r"duration must be seconds > 0.*got -2.*Fix"):
        LinkDown(host=1, after="go", duration=-2)
    with pytest.raises(ValueError, match="host must be a host index >= 0, got True"):
        LinkDown(host=True, after="go")
    # The absolute form as before (positional too); numbers become seconds as floats.
    assert LinkDown(1, 20, 2) == LinkDown(host=1, at=20.0, duration=2.0, after=None)
    assert repr(LinkDown(1, 20, 2)) == "LinkDown(host=1, at=20.0, duration=2.0)"
    f = LinkDown(host=1, after="epoch-2.step_3")
    assert (f.at, f.duration) == (0.0, None)
    assert repr(f) == "LinkDown(host=1, at=0.0, duration=None, after='epoch-2.step_3')"


def test_link_down_parses_the_command_line_forms(capsys):
    from jaxsync.cluster import LinkDown, cli

    forms = {
        "1@5+2": LinkDown(1, at=5.0, duration=2.0),
        "0@3": LinkDown(0, at=3.0),
        "1@step-3": LinkDown(1, after="step-3"),
        "1@step-3+2": LinkDown(1, after="step-3", duration=2.0),
        "1@step-3:0.5": LinkDown(1, after="step-3", at=0.5),
        " 2 @ go : 1.5 + 3 ": LinkDown(2, after="go", at=1.5, duration=3.0),
        "1@e5+2": LinkDown(1, after="e5", duration=2.0),  # a letter first: a marker
    }
    for text, want in forms.items():
        assert LinkDown.parse(text) == want, text
    for bad in ("1 at 5", "1@", "@go", "x@go", "1@go+", "1@go:+2", "1@go:1:2", "1@-go", "1@go 3"):
        with pytest.raises(ValueError, match=r"--link-down must be HOST@SECONDS.*HOST@MARKER"):
            LinkDown.parse(bad)
    with pytest.raises(ValueError, match="LinkDown.after must be a marker name"):
        LinkDown.parse("1@" + "a" * 65)
    args = cli.parse(["--link-down", "1@step-3:1+2", "--link-down", "0@7", "--", "python"])
    assert args.link_down == [LinkDown(1, after="step-3", at=1.0, duration=2.0), LinkDown(0, 7.0)]
    with pytest.raises(SystemExit):
        cli.parse(["--link-down", "1@step 3", "--", "python"])
    assert "--link-down must be HOST@SECONDS" in capsys.readouterr().err


def test_the_spec_carries_a_marker_to_the_supervisor():
    from jaxsync.cluster import LinkDown
    from jaxsync.cluster._spec import Spec

    faults = (LinkDown(1, after="step-3", at=0.5, duration=2.0), LinkDown(0, at=4.0))
    spec = Spec(hosts=2, procs_per_host=1, link="1gbit", faults=faults)
    assert Spec.from_json(spec.to_json()) == spec


def test_a_fault_counts_from_the_first_mark_and_waits_for_it(tmp_path, monkeypatch):
    import threading

    import jaxsync.cluster as jc
    from jaxsync.cluster import _inside
    from jaxsync.cluster._spec import Spec, read_mark

    monkeypatch.delenv("JAXSYNC_CLUSTER_MARKS", raising=False)
    assert jc.mark("go") is False  # outside a cluster run: nothing to do
    with pytest.raises(ValueError, match=r"jaxsync\.cluster\.mark: name must be a marker name"):
        jc.mark("step 3")  # checked outside a run too
    monkeypatch.setenv("JAXSYNC_CLUSTER_MARKS", str(tmp_path))
    monkeypatch.setenv("PMI_RANK", "1")
    before = time.time()
    assert jc.mark("go") is True
    first = read_mark(tmp_path, "go")
    assert first is not None and first[1] == "1" and before <= first[0] <= time.time()
    monkeypatch.setenv("PMI_RANK", "0")
    assert jc.mark("go") is True
    assert read_mark(tmp_path, "go") == first  # the first call counts, on any rank
    assert [p.name for p in tmp_path.iterdir()] == ["go"]  # nothing else left there
    stop = threading.Event()
    after = jc.LinkDown(host=1, after="go", at=1.5, duration=2.0)
    assert _inside.fault_time(after, 100.0, tmp_path, stop) == first[0] + 1.5
    assert _inside.fault_time(jc.LinkDown(host=1, at=4.0), 100.0, tmp_path, stop) == 104.0
    # A marker that never comes: the fault waits until the run ends, then never fires.
    never = jc.LinkDown(host=0, after="never")
    due: list[float | None] = []
    waiter = threading.Thread(
        target=lambda: due.append(_inside.fault_time(never, 0, tmp_path, stop))
    )
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and due == []  # still waiting: no marker, no time
    stop.set()  # the run ends
    waiter.join(10)
    assert due == [None]
    spec = Spec(hosts=2, procs_per_host=1, link="1gbit", faults=(after, never))
    assert _inside.unmarked(spec, tmp_path) == [
        "the fault on host0's link after marker 'never' never fired: no rank called "
        "jaxsync.cluster.mark('never')"
    ]


def test_a_fault_after_a_marker_follows_the_program_not_the_clock(cluster):
    """The program reaches its marker later than the fault's ``at`` (a slow
    start-up, as on a busy machine): the link still goes down ``at`` after the
    marker, while the program watches it (counted from the launch, it would have
    been down and up again before). A marker that never comes: that fault never
    fires and the run ends as it would without it."""
    go = cluster.LinkDown(host=1, after="go", at=1.0, duration=1.0)
    never = cluster.LinkDown(host=0, after="never", duration=1.0)
    cmd = [PY, HERE / "worker_mark.py", "--rank", "1", "--delay", "3", "--marker", "go"]
    r = cluster.run(cmd, hosts=2, link_down=[go, never], env=worker_env(), timeout=120)
    assert r.returncode == 0 and not r.timed_out, r.output
    (line,) = [ln for ln in r.output.splitlines() if ln.startswith("[host1 r1] {")]
    d = json.loads(line.split("] ", 1)[1])
    assert d["marked"] > go.at + go.duration, d  # the premise: a fault at 1 s would be over
    assert d["up_at_mark"], d
    assert d["down"] is not None and d["down"] >= d["marked"] + go.at, d
    assert d["up"] is not None and d["up"] > d["down"], d
    assert "host1's link down for 1 s (1 s after marker 'go')" in r.output, r.output
    assert "host0's link down" not in r.output, r.output
    assert "the fault on host0's link after marker 'never' never fired" in r.output, r.output


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


@contextlib.contextmanager
def _cli(args, out):
    """``python -m jaxsync cluster ARGS -- worker_probe.py --sleep 300`` in its own
    session; whatever the test does, the session is killed and the pipe closed on the
    way out (a Popen left running and collected later warned inside another test)."""
    cmd = [PY, "-m", "jaxsync", "cluster", *args, "--", PY, HERE / "worker_probe.py"]
    proc = subprocess.Popen(
        [str(c) for c in cmd + ["--out", out, "--sleep", "300"]],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=worker_env(),
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.communicate(timeout=60)  # reaps it and closes the pipe


def _wait_for_ranks(out: Path, n: int, proc, limit=90):
    deadline = time.monotonic() + limit
    while len(list(out.glob("rank*.pid"))) < n:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.2)
    # Until their output has gone through: a stop must not depend on a later
    # write meeting a closed pipe.
    time.sleep(3)


def _processes_naming(out: Path) -> list[str]:
    """Processes whose command line names ``out`` (every rank of the run does)."""
    left = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and proc.name != str(os.getpid()):
            try:
                if str(out) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    left.append(f"process {proc.name}")
            except OSError:
                pass
    return left


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "kill -9"])
def test_nothing_is_left_after_a_run_that_is_stopped(cluster, tmp_path, how):
    before = namespaces()
    with _cli(["--hosts", "2", "--procs-per-host", "2"], tmp_path) as proc:
        _wait_for_ranks(tmp_path, 4, proc)
        assert left_over(tmp_path), "the probe should see the running ranks"
        sig = {"ctrl-c": signal.SIGINT, "sigterm": signal.SIGTERM, "kill -9": signal.SIGKILL}
        os.kill(proc.pid, sig[how])
        out, _ = proc.communicate(timeout=180)  # a bound for a hang, not a speed test
    if how in ("ctrl-c", "sigterm"):
        assert proc.returncode != 0, out
        assert "[cluster] interrupted" in out, out
    _assert_nothing_left(tmp_path, before)


def test_nothing_is_left_after_the_time_limit(cluster, tmp_path):
    """The time limit runs on the clock from the job's start, so where it finds the
    job depends on the machine's speed: every rank running (a fast machine), some
    started, or none yet (a slow one: a fixed 8 s once fired before 4 ranks had
    started). Whatever it found, nothing may be left, and the status is 124. Ranks
    running when a stop comes are what the signal cases above check."""
    before = namespaces()
    with _cli(["--hosts", "2", "--procs-per-host", "2", "--timeout", "10"], tmp_path) as proc:
        out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 124, out
    assert "time limit of 10 s reached" in out, out
    _assert_nothing_left(tmp_path, before)


def _assert_nothing_left(out: Path, before: str) -> None:
    deadline = time.monotonic() + 10  # the kernel reaps a dead PID namespace at once
    started = bool(list(out.glob("rank*.pid")))
    while time.monotonic() < deadline and (_processes_naming(out) or (started and left_over(out))):
        time.sleep(0.2)
    assert _processes_naming(out) == []
    if started:
        assert left_over(out) == []
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

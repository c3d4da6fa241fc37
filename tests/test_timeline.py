"""jaxsync.timeline in one process (the files, the command, JAXSYNC_TIMELINE);
tests/mpi/test_timeline_mpi.py records real calls under mpirun."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

import jaxsync
from jaxsync._cli import _timeline as cli
from jaxsync._comm import _timeline

# Two ranks' events as the native recorder gives them (kind, comm, bytes,
# queued, started, ended in ns, thread, lane): two allreduces on one thread, an
# async sum on the world's lane.
T0 = 10**9
MS = 10**6  # ns


def _events(shift):
    return np.array(
        [
            [0, 7, 400, -1, T0 + 1 * MS + shift, T0 + 3 * MS + shift, 11, 0],
            [1, 7, 800, T0 + 3 * MS + MS // 2, T0 + 4 * MS + shift, T0 + 9 * MS + shift, 12, 1],
            [
                0,
                7,
                400,
                -1,
                T0 + 9 * MS + MS // 2 + shift,
                T0 + 9 * MS + 9 * MS // 10 + shift,
                11,
                0,
            ],
        ],
        np.int64,
    )


def _write(tmp_path, rank, shift=0):
    steps = [(0, T0, T0 + 5 * MS + shift), (1, T0 + 5 * MS + shift, T0 + 10 * MS + shift)]
    return _timeline.write(tmp_path, rank, _events(shift), steps, T0, {7: "world"})


def test_a_rank_file_is_a_chrome_trace_with_lanes_and_steps(tmp_path):
    doc = json.loads(_write(tmp_path, 3).read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in xs] == [
        "step 0",
        "step 1",
        "allreduce",
        "allreduce_async",
        "allreduce",
    ]
    assert {e["pid"] for e in doc["traceEvents"]} == {3}
    a, lane, b = xs[2:]
    want = {"communicator": "world", "bytes": 400, "step": 0, "call": 0}
    assert (a["ts"], a["dur"], a["args"]) == (1000.0, 2000.0, want)
    assert lane["args"]["queued_us"] == 500.0 and lane["args"]["step"] == 0
    assert b["args"]["step"] == 1 and a["tid"] == b["tid"] != lane["tid"]
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert names == {
        0: "steps",
        a["tid"]: "XLA thread 1",
        lane["tid"]: "communication lane (world)",
    }


def test_calls_are_numbered_per_step_and_overlaps_sums_by_bucket(tmp_path):
    # one step: three async sums queued out of their recording order, two
    # allreduces on another communicator and the host tier's pipelined call
    q = lambda ms: T0 + ms * MS
    events = np.array(
        [
            [1, 7, 100, q(2), q(6), q(7), 12, 1],
            [1, 7, 100, q(1), q(2), q(3), 12, 1],
            [0, 8, 100, -1, q(4), q(5), 11, 0],
            [1, 7, 100, q(3), q(7), q(8), 12, 1],
            [0, 8, 100, -1, q(1), q(2), 11, 0],
            [8, 9, 100, -1, q(8), q(9), 11, 0],
        ],
        np.int64,
    )
    path = _timeline.write(tmp_path, 0, events, [("s", T0, q(10))], T0, {7: "world", 8: "x"})
    xs = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "communication"]
    sums = [(e["ts"], e["args"]["bucket"]) for e in xs if e["name"] == "allreduce_async"]
    assert sorted(sums) == [(2000.0, 0), (6000.0, 1), (7000.0, 2)]  # in the order queued
    calls = [(e["ts"], e["args"]["call"]) for e in xs if e["name"] == "allreduce"]
    assert sorted(calls) == [(1000.0, 0), (4000.0, 1)]
    assert all("bucket" not in e["args"] for e in xs if e["name"] != "allreduce_async")
    (tier,) = [e for e in xs if e["name"] == "tier"]
    assert tier["args"]["call"] == 0


def test_the_command_merges_ranks_draws_and_summarises(tmp_path):
    _write(tmp_path, 0)
    _write(tmp_path, 1, shift=100)
    assert cli.main([str(tmp_path)]) == 0
    merged = json.loads((tmp_path / "timeline.json").read_text())
    assert {e["pid"] for e in merged["traceEvents"]} == {0, 1}
    assert [name for _, _, name in cli.lanes(merged)][:3] == [
        "steps",
        "XLA thread 1",
        "communication lane (world)",
    ]
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    # 2 + 5 + 0.4 ms in calls of 10 ms of steps
    assert cli.summary(cli.load(tmp_path))[0] == (
        "rank 0: 3 calls, 2 steps, 7.4 ms in calls, 74% of the steps' 10.0 ms"
    )


def test_no_files_is_a_clear_error(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "jaxsync", "timeline", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "no rank*.json" in r.stderr and "jaxsync.timeline" in r.stderr


def test_steps_only_without_mpi_and_the_environment_variable(tmp_path):
    with jaxsync.timeline(tmp_path / "ctx") as tl:
        with tl.step("a"):
            pass
    doc = json.loads(tl.path.read_text())
    assert [e["name"] for e in doc["traceEvents"] if e["ph"] == "X"] == ["step a"]
    # JAXSYNC_TIMELINE=DIR: the whole run, written at exit.
    env = dict(os.environ, JAXSYNC_TIMELINE=str(tmp_path / "env"))
    code = "import jaxsync, jax.numpy as jnp; print(float(jnp.ones(2).sum()))"
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "env" / "rank0.json").read_text())
    assert doc["otherData"]["rank"] == 0


def test_a_communicator_without_handles_does_not_break_freeing(monkeypatch):
    """A stand-in communicator (the tests' fakes) in jaxsync's cache: the timeline's
    names skip it, and free_communicators (which asks for them first) still frees."""
    from jaxsync._comm import _topology

    class Fake:
        freed = False

    monkeypatch.setitem(_topology.Comms._cache, -1, Fake())
    assert isinstance(_timeline.comm_labels(), dict)
    _timeline._remember()

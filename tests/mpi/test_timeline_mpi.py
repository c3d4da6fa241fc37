"""jaxsync.timeline under mpirun -n 2 x 2 devices (worker_timeline.py), and
python -m jaxsync timeline merging the ranks' files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi_harness import requires_mpi, run_mpi

pytestmark = requires_mpi


@pytest.fixture(scope="module")
def timeline_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("timeline")
    run = run_mpi("worker_timeline.py", n=2, devices=2, args=("--dir", str(d)), timeout=240)
    return run.check(), d


def _calls(doc):
    return [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "communication"]


def test_the_files_parse_and_every_call_sits_in_its_step(timeline_run):
    run, d = timeline_run
    for rank in range(2):
        doc = json.loads((d / f"rank{rank}.json").read_text())
        assert doc["otherData"]["rank"] == rank and doc["otherData"]["native"]
        steps = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "step"]
        assert [e["name"] for e in steps] == [
            f"step {n} {i}" for n in ("hierarchical", "overlap") for i in range(3)
        ]
        calls = _calls(doc)
        kinds = {e["name"] for e in calls}
        assert {"allreduce", "allreduce_async"} <= kinds, kinds
        for e in calls:  # each call inside its step (every step blocks on its results)
            assert e["args"]["step"] is not None, e
            (s,) = [x for x in steps if x["args"]["step"] == e["args"]["step"]]
            assert s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1, (e, s)
            assert e["dur"] >= 0 and e["args"]["bytes"] >= 0
        # Events of one lane never overlap (they nest: one call at a time per thread).
        by_lane = {}
        for e in calls:
            by_lane.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
        for spans in by_lane.values():
            spans.sort()
            assert all(a[1] <= b[0] + 1e-3 for a, b in zip(spans, spans[1:])), spans
        lanes = [e for e in calls if e["name"] == "allreduce_async"]
        assert all("queued_us" in e["args"] for e in lanes)
        # overlap's sums are numbered by bucket, in each step 0, 1, ... as issued
        for s in steps:
            got = [e["args"]["bucket"] for e in lanes if e["args"]["step"] == s["args"]["step"]]
            if s["name"].startswith("step overlap"):
                assert got and sorted(got) == list(range(len(got))), (s, got)
            else:
                assert got == [], (s, got)
        assert all(isinstance(e["args"]["call"], int) for e in calls)
        for e in calls:  # named: the agreement's communicator, the world's (per device)
            want = "agreement" if e["name"] == "agree" else "world"
            assert e["args"]["communicator"].startswith(want), e


def test_every_rank_issues_the_same_calls_in_the_same_order(timeline_run):
    run, d = timeline_run
    seqs = []
    for rank in range(2):
        doc = json.loads((d / f"rank{rank}.json").read_text())
        seqs.append(
            [
                (e["name"], e["args"]["communicator"], e["args"]["bytes"], e["args"]["step"])
                for e in sorted(_calls(doc), key=lambda e: e["ts"])
                if e["name"] != "agree"
            ]
        )
    assert seqs[0] == seqs[1]
    # The sums carry the gradients' bytes: 4 leaves of 1000 + 100 k float32 each step.
    for step in ("hierarchical 0", "overlap 2"):
        total = sum(b for _, _, b, s in seqs[0] if s == step)
        assert total == 4 * sum(1000 + 100 * k for k in range(4)), (step, seqs[0])


def test_the_lowered_step_does_not_change_and_the_means_are_exact(timeline_run):
    run, _ = timeline_run
    for rank in range(2):
        res = run.results[rank]
        assert res["lowered_on"] == res["lowered_off"]
        for name, outs in res["outs"].items():
            for out in outs:
                for k in range(4):
                    want = np.full((2, 1000 + 100 * k), 1.5 + k, np.float32)  # (4 - 1)/2 + k
                    np.testing.assert_array_equal(out[f"g{k}"], want, err_msg=name)


def test_the_command_merges_the_ranks_and_draws_them(timeline_run):
    _, d = timeline_run
    r = subprocess.run(
        [sys.executable, "-m", "jaxsync", "timeline", str(d)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    merged = json.loads((d / "timeline.json").read_text())
    assert {e["pid"] for e in merged["traceEvents"]} == {0, 1}
    assert (d / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "rank 0: " in r.stdout and "rank 1: " in r.stdout


def test_the_environment_variable_records_the_whole_run_with_names(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSYNC_TIMELINE", str(tmp_path / "tl"))
    run = run_mpi("worker_timeline_env.py", n=2, devices=1, timeout=180, out=tmp_path / "o")
    run.check()
    one = [("agree", "agreement", 0), ("allreduce", "world", 256)]  # a step's calls
    for rank in range(2):
        doc = json.loads((tmp_path / "tl" / f"rank{rank}.json").read_text())
        calls = [(e["name"], e["args"]["communicator"], e["args"]["bytes"]) for e in _calls(doc)]
        # Named although jaxsync freed its communicators at exit before the file was
        # written; the five steps, also the two a `with jaxsync.timeline` block recorded.
        assert calls == one * 5, calls
        inner = json.loads(Path(run.results[rank]["inner"]).read_text())
        calls = [(e["name"], e["args"]["communicator"], e["args"]["bytes"]) for e in _calls(inner)]
        assert calls == one * 2, calls

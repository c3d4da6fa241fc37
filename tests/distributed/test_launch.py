"""The launcher reads every worker's results whatever else the worker prints."""

from pathlib import Path

from _launch import run_workers


def test_results_survive_c_level_stdout_writes():
    rows = run_workers(Path(__file__).with_name("worker_noisy.py"), timeout=60)
    assert sorted((r["pid"], r["k"]) for r in rows) == [(p, k) for p in (0, 1) for k in range(3)]

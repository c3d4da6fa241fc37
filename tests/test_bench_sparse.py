"""Smoke test of ``python -m jaxsync bench --suite sparse --quick`` (one process).

Figures are not checked (the machine is shared); what is: the suite runs through
the ``--suite`` dispatch, writes its JSON, and every synchronised result scattered
to the same dense mean (the ``correct`` column).
"""

import json

from _bench import run_module


def test_quick_sparse_suite(tmp_path):
    proc = run_module(
        "jaxsync", "bench", "--suite", "sparse", "--quick", "--out", tmp_path, timeout=180
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "sparse.json").read_text())
    methods = {r["method"] for r in result["rows"]}
    assert {"sparse", "dense", "auto"} <= methods
    assert {r["k"] for r in result["sweep"]} == {16, 2048}
    for r in result["rows"] + result["sweep"]:
        assert r["correct"] is True, r
        assert len(r["samples_ms"]) == 2
    sides = {(r["k"], r["method"]): r["side"] for r in result["sweep"]}
    assert sides[(16, "sparse")] == "sparse" and sides[(2048, "dense")] == "dense"

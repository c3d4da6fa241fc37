"""Smoke test of ``python -m jaxsync bench --suite weights`` (one process, a small
tree, one round): it runs through the ``--suite`` dispatch, times every case,
checks that with even inputs the weighted result is the plain one bitwise, and
writes its JSON. Speed is not asserted."""

import json

from jaxsync.bench import cli


def test_the_weights_suite_times_every_case_on_equal_results(tmp_path):
    argv = ["--suite", "weights", "--tree", "small", "--rounds", "1", "--iters", "1"]
    assert cli.main([*argv, "--out", str(tmp_path)]) == 0
    got = json.loads((tmp_path / "weights-one-process.json").read_text())
    med = got["median_s"]
    assert set(med) == {
        f"{w}/{k}" for w in ("float32", "bfloat16") for k in ("plain", "weights")
    } | {"bare"}
    assert got["same"] == {"float32": True, "bfloat16": True}
    for t in got["targets"]:
        wire = t["what"].split()[1]
        assert t["value"] == med[f"{wire}/weights"] / med[f"{wire}/plain"]

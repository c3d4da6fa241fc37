"""Smoke test of ``python -m jaxsync bench --suite weights`` (one process, a tiny
stack, one round): it runs through the ``--suite`` dispatch, times every case,
checks that with even inputs the weighted step's parameters are the plain one's
bitwise, and writes its JSON. Speed is not asserted."""

import json

from jaxsync.bench import cli


def test_the_weights_suite_times_every_case_on_equal_results(tmp_path):
    argv = ["--suite", "weights", "--layers", "1", "--width", "8", "--batch", "4"]
    argv += ["--rounds", "1", "--iters", "1", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    got = json.loads((tmp_path / "weights-one-process.json").read_text())
    med = got["median_s"]
    cases = {f"{w}/{k}" for w in ("float32", "bfloat16") for k in ("plain", "weights")}
    assert set(med) == cases | {"compute", "sync"}
    assert got["same"] == {"float32": True, "bfloat16": True}
    for t in got["targets"]:
        wire = t["what"].split()[1].lstrip("(")
        assert t["value"] == (med[f"{wire}/weights"] - med[f"{wire}/plain"]) / med["sync"]

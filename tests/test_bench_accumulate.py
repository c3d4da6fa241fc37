"""Smoke test of ``python -m jaxsync bench --suite accumulate`` (one process, a
tiny stack, one round): it runs through the ``--suite`` dispatch, counts the
synchronisations per k micro-steps (k for MultiSteps, 1 for accumulate) and
writes its JSON. Speed is not asserted."""

import json

from jaxsync.bench import cli


def test_the_accumulate_suite_counts_one_sync_per_k(tmp_path):
    argv = ["--suite", "accumulate", "--k", "3", "--layers", "1", "--width", "8"]
    argv += ["--batch", "4", "--rounds", "1", "--iters", "1", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    got = json.loads((tmp_path / "accumulate-one-process.json").read_text())
    assert got["syncs"] == {"compute": 0, "multisteps": 3, "accumulate": 1}
    assert got["targets"][0]["value"] == 1 / 3
    assert set(got["median_s"]) == {"compute", "multisteps", "accumulate", "sync"}

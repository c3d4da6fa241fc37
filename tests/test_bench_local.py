"""Smoke test of ``python -m jaxsync bench --suite local-updates`` (one process, a
tiny model, a few steps): it runs through the ``--suite`` dispatch, trains data
parallel and DiLoCo on the standard library's source, records eval losses every
``H`` steps, counts one sync per step for data parallel and one per ``H`` for
DiLoCo, and writes its JSON and plot. Speed is not asserted."""

import json

from jaxsync.bench import cli


def test_the_local_updates_suite_trains_and_reports(tmp_path):
    argv = ["--suite", "local-updates", "--methods", "data-parallel,diloco", "--steps", "4"]
    argv += ["--max-steps", "6", "--every", "2", "--width", "16", "--layers", "1", "--seq", "8"]
    argv += ["--batch", "2", "--eval-batches", "1", "--corpus-bytes", "100000"]
    assert cli.main([*argv, "--out", str(tmp_path)]) == 0
    got = json.loads((tmp_path / "local-updates-one-process.json").read_text())
    dp, lo = got["results"]["data-parallel"], got["results"]["diloco"]
    assert [c[0] for c in dp["curve"]] == [2, 4] and dp["syncs"] == 4
    assert lo["curve"][-1][0] in (4, 6) and lo["syncs"] == lo["curve"][-1][0] // 2
    assert all(c[2] > 0 for c in dp["curve"] + lo["curve"])  # nats per byte
    assert (tmp_path / "local-updates-one-process.png").stat().st_size > 0
    assert {t["limit"] for t in got["targets"]} == {0.5, 0.02}

"""``python -m jaxsync bench --suite cluster --quick``: runs inside the emulated
cluster and writes its table, JSON and plot, every row beside the link's limit."""

import json
import subprocess
import sys

from cluster_harness import worker_env


def test_cluster_suite_quick(cluster, tmp_path):
    del cluster  # the fixture: skip (or fail in CI) where the cluster cannot run
    cmd = [sys.executable, "-m", "jaxsync", "bench", "--suite", "cluster", "--quick"]
    r = subprocess.run(
        [*cmd, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=worker_env(),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for name in ("cluster.json", "cluster.md", "cluster.png", "cluster-timeline.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    d = json.loads((tmp_path / "cluster.json").read_text())
    (res,) = d["results"]
    assert res["name"] == "2x1x1@1gbit" and res["rate_bps"] > 0
    methods = {row["method"] for row in d["table"]}
    for m in ("hierarchical", "hierarchical bf16", "mpi4jax/leaf", "jax.distributed pmean"):
        assert m in methods, methods
    assert "powersgd r4 (compress suite)" in methods and "sign (compress suite)" in methods
    for row in d["table"]:
        # the link's limit: the whole tree over the measured rate (2 hosts)
        assert abs(row["limit_ms"] - row["tree_bytes"] * 8 / res["rate_bps"] * 1e3) < 1e-6
    assert any(t["name"] == "hierarchical <= jax.distributed pmean" for t in d["targets"])
    # beside every figure the CPU share: per case for the bench's rows, per run for
    # the compression suite's
    for row in d["table"]:
        assert row["cpu_scope"] == ("run" if row["kind"] == "compress" else "case"), row
        assert 0 <= row["cpu_busy"] <= 1 or row["cpu_scope"] == "case", row
    assert any(0 < row["cpu_busy"] <= 1 for row in d["table"] if row["cpu_scope"] == "case")
    assert "| CPU busy |" in (tmp_path / "cluster.md").read_text()
    # the timeline of the first configuration, after its timed runs
    assert d["meta"]["timeline"]["config"] == "2x1x1@1gbit", d["meta"]["timeline"]
    assert {"rank0.json", "rank1.json"} <= {p.name for p in (tmp_path / "timeline").iterdir()}

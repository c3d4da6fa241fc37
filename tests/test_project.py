"""tune --project for a user's cluster: the model, the CLI's question, the published
figures it is held to, and the overlap suite it is checked against (no mpirun)."""

from __future__ import annotations

import argparse
import glob
import json
import math
from pathlib import Path

import jax.numpy as jnp
import pytest

from jaxsync.auto import (
    _cost,
    _cost_ops,
    _project,
    _project_cli,
    _project_model,
    _project_trees,
    _published,
)

ROOT = Path(__file__).resolve().parents[1]


def test_published_held_out_within_25_percent_on_3_in_4():
    rows = _published.evaluate()
    assert len(rows) >= 7
    ok = [r for r in rows if r["ok"]]
    assert len(ok) >= 0.75 * len(rows), _published.accuracy_table()
    # every row cites a source and states its uncertainty
    for r in _published.rows():
        assert r["source"]["url"].startswith("https://") and r["uncertainty"]
        assert r["split"] in ("fit", "held_out", "untested")


def test_defaults_are_the_fit_rows():
    fit = _published.fit_defaults()
    lat, c = _project_model.NcclLatency(), _project_model.Cluster(hosts=2)
    assert math.isclose(lat.hop, fit["hop"], rel_tol=0.01)
    assert math.isclose(lat.intra, fit["intra"], rel_tol=0.01)
    assert math.isclose(c.intra_eff, fit["intra_eff"], rel_tol=0.01)
    assert math.isclose(c.net_eff, fit["net_eff"], rel_tol=0.01)


def test_nccl_ring_and_tree_by_scale():
    # 2 hosts: the tree sends the buffer once per host; more: about the ring's bytes
    c2 = _project_model.Cluster(hosts=2, devices=8, rails=8, net_gbps=400)
    c16 = _project_model.Cluster(hosts=16, devices=8, rails=8, net_gbps=400)
    assert _project_model.nccl_allreduce(2**30, c2)[1] == "tree"
    ring_bytes = 2 * 127 / 128 * 2**30 / min(c16.node_bw, c16.intra_bw)
    assert _project_model.nccl_allreduce(2**30, c16)[0] <= ring_bytes + 300e-6
    # small buffers: latency grows with the hosts (tree depth), not flat
    small = [_project_model.nccl_allreduce(8, c)[0] for c in (c2, c16)]
    assert small[1] > small[0] > 40e-6


def test_exposed_closed_forms():
    e = _project_model.exposed(sync=3.0, compute=2.0, backward=0.5, buckets=2)
    assert e["blocking"]["step_s"] == 5.0
    assert e["overlap"]["step_s"] == max(2.0 + 1.5, 1.0 + 3.0)
    assert e["double"]["step_s"] == 3.0 and e["double"]["efficiency"] == 2.0 / 3.0


def test_overlap_form_against_the_measured_overlap_suite():
    # step with overlap = max(compute, forward + sync) (buckets small), double
    # buffering = max(compute, sync): measured medians of docs/bench/overlap
    checked = 0
    for path in sorted(glob.glob(str(ROOT / "docs/bench/overlap/*.json"))):
        m = json.loads(Path(path).read_text())["median_s"]
        if not {"nosync", "forward", "bare", "double"} <= set(m):
            continue
        over = next((v for k, v in m.items() if k.startswith("overlap")), None)
        share = 1 - m["forward"] / m["nosync"]
        e = _project_model.exposed(m["bare"], m["nosync"], share, buckets=8)
        assert 0.85 < m["double"] / e["double"]["step_s"] < 1.1, (path, m)
        if over is not None:
            assert 0.9 < over / e["overlap"]["step_s"] < 1.15, (path, m)
        checked += 1
    assert checked >= 3


def test_profile_without_topology_is_an_error_naming_it(tmp_path):
    # the old --profile silently replaced a hand-written profile without
    # "topology" by the stated figures (every figure "assumed")
    data = _cost.DEFAULT_PROFILE.to_json()
    del data["topology"]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match=r"lacks \['topology'\]"):
        _project.run_project(path, False)  # the old code printed every figure "assumed"
    data["topology"] = None  # said explicitly: its links are used, and say so
    path.write_text(json.dumps(data))
    prof = _project.read_profile(path)
    _, _, figures = _project.measured_projection(prof, "p.json")
    assert dict((f, h) for f, _, h in figures)["network link"].startswith("measured")


def test_a_measured_profile_keeps_the_gpu_path(tmp_path, capsys, monkeypatch):
    # the old run_project priced jaxsync's native CPU target whenever the
    # profile had a topology (every profile tune writes): not the GPU path
    prof = _cost.Profile(
        (("network", _cost.Link(2e-5, 8e-9, 3e-10)),), 2e-10, {"processes": 2, "hosts": 2}
    )
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof.to_json()))
    seen = []

    def project(**kw):
        seen.append(kw["native"])
        return [{"network": "m", "tree": "t", "hosts": 8, "devices": 8, "ms": {}, "choice": ""}]

    monkeypatch.setattr(_project, "project", project)
    assert _project.run_project(path, True) == 0
    assert seen == [False]  # the old code: [True]
    assert _project.run_project(path, True, native=True) == 0  # --backend cpu
    assert seen == [False, True]
    capsys.readouterr()
    # in a question, the links it lacks come from the flags, and it says so
    ans = _project_cli.question(_args(tree="small500", hosts="2"), prof)
    assert ans["rows"][0]["paths"]


def test_staging_reaches_the_model():
    b = [_cost_ops.BucketInfo("float32", 8 << 20)]
    dev = _cost_ops.ModelTopology(processes=4, hosts=4, native=False)
    host = _cost_ops.ModelTopology(processes=4, hosts=4, native=False, staging="host")
    prof = _cost.Profile(_cost.DEFAULT_PROFILE.links, 1e-10, stage=1e-9)
    extra = _cost_ops.predict("flat", b, host, prof) - _cost_ops.predict("flat", b, dev, prof)
    assert math.isclose(extra, 2 * (8 << 20) * 1e-9, rel_tol=1e-9)


def test_native_pieces_and_tier_pipeline_are_cheaper_than_serial():
    b = [_cost_ops.BucketInfo("float32", 16 << 20)]
    topo = _cost_ops.ModelTopology(processes=8, hosts=2, host_tier=True)
    ops = _cost_ops.strategy_ops("flat", b, topo)
    piped = [op for op in ops if op.chunks > 1]
    assert len(piped) == 3 and piped[0].chunks == 32  # reduce, hosts, broadcast
    serial = sum(op.seconds(_cost.DEFAULT_PROFILE) for op in ops if op.kind not in ("strategy",))
    assert _cost_ops.predict("flat", b, topo) < serial
    inter = next(op for op in ops if op.stage == "inter")
    assert inter.piece == 512 << 10


def test_tree_spec_round_trip_and_params(tmp_path):
    path = tmp_path / "t.json"
    _project_trees.save_tree_spec({"a": jnp.zeros((3, 5)), "b": {"c": jnp.zeros(2)}}, path)
    tree, label = _project_trees.load_tree(tree_file=path)
    assert {k: v.shape for k, v in tree.items()} == {"a": (3, 5), "b/c": (2,)}
    assert "17 params, 2 leaves" in label
    with pytest.raises(ValueError, match="exactly one"):
        _project_trees.load_tree("resnet50", 1e6)


def _args(**kw):
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=None)
    p.add_argument("--profile", default=None)
    p.add_argument("--json", action="store_true")
    _project_cli.add_args(p)
    ns = p.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_question_answers_every_path():
    args = _args(tree="resnet50", hosts="8,64", compute_ms=200.0, every=4, wire_bits=8)
    ans = _project_cli.question(args)
    assert [r["hosts"] for r in ans["rows"]] == [8, 64]
    for r in ans["rows"]:
        names = list(r["paths"])
        assert any(n.startswith("nccl flat") for n in names)
        assert f"{r['auto']} (mpi4jax)" in names
        for cell in r["paths"].values():
            assert cell["every"]["sync_ms"] == pytest.approx(cell["sync_ms"] / 4)
            assert 0 < cell["blocking"]["efficiency"] <= cell["overlap"]["efficiency"] <= 1
            assert cell["overlap"]["efficiency"] <= cell["every"]["overlap"]["efficiency"]
    assert sum("PLACEHOLDER" in n for n in ans["notes"]) == 2
    text = _project_cli.render(ans, True)
    assert "auto picks" in text and "double buffering" in text and "every H" in text


def test_in_sample_emulated_cluster_rows():
    # this machine's cluster runs: one process a host, wire-bound: within 10%;
    # several processes a host at 1 Gb/s: CPU-bound (the README says so)
    rows = _published.in_sample(ROOT / "docs/bench/cluster")
    assert len(rows) == 30
    one = [r for r in rows if r["config"] == "2x1x1@1gbit"]
    assert one and all(0.9 <= r["ratio"] <= 1.1 and not r["cpu_bound"] for r in one)
    many = [r for r in rows if r["config"] in ("2x2x1@1gbit", "2x4x1@1gbit")]
    assert many and all(r["cpu_bound"] for r in many)
    assert not any(r["cpu_bound"] for r in rows if "100mbit" in r["config"])

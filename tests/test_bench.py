"""Smoke test of the benchmark (jaxsync/bench/): it runs and writes its files.

The figures are not compared with targets here (the benchmark evaluates those);
what is checked: every row's statistics are finite and ordered, and every method
that averages gradients gave their mean (the JSON's ``correct`` column). The run
is ``--quick``, in a subprocess so that its device count does not depend on this
pytest process, which already has 8 devices.
"""

import ast
import json
import math
import os
import types

import pytest
from _bench import ROOT, run_module


def test_quick_bench_writes_json_csv_and_png(tmp_path):
    proc = run_module("jaxsync.bench", "--quick", "--out", tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for suffix in ("json", "csv", "png"):
        path = tmp_path / f"intra.{suffix}"
        assert path.is_file() and path.stat().st_size > 0, path
        assert str(path) in proc.stdout
    result = json.loads((tmp_path / "intra.json").read_text())
    rows = result["rows"]
    assert result["meta"]["devices"] == 8 and result["meta"]["processes"] == 1

    expected = {
        "naive",
        "flat",
        "hierarchical",
        "two_dimensional",
        "single_node",
        "hierarchical bf16",
        "pmean/leaf",
        "pmean/tree",
        "ravel+pmean",
        "psum bare",
    }
    for tree in result["meta"]["trees"]:
        got = {row["method"] for row in rows if row["tree"] == tree}
        assert expected <= got, (tree, expected - got)
    assert any(row["kind"] == "sweep" for row in rows)
    for row in rows:
        assert len(row["samples_ms"]) == 2 and row["wire_bytes"] > 0
        times = [row[k] for k in ("min_ms", "q25_ms", "median_ms", "q75_ms", "max_ms")]
        assert all(math.isfinite(t) for t in times), row
        assert times == sorted(times), row  # min <= q25 <= median <= q75 <= max
        assert row["iters"] >= 1 and row["ops"] >= 0, row
    # Every method that averages the tree gives its mean (a wrong divisor, a lost
    # or mixed-up leaf fails), and every jaxsync strategy was checked and compiled.
    checked = [row for row in rows if row["correct"] is not None]
    assert {"naive", "flat", "hierarchical", "two_dimensional", "single_node"} <= {
        row["method"] for row in checked
    }
    bad = [(row["tree"], row["method"]) for row in checked if row["correct"] is not True]
    assert not bad, bad
    for row in rows:
        if row["kind"] == "jaxsync":
            assert row["correct"] is True and row["compile_s"] > 0, row
            assert row["ops"] >= 1, row  # it really has collectives
    assert result["targets"]
    assert any(tag in proc.stdout for tag in ("PASS", "MISS", "N/A"))


def test_flat_defaults_are_the_librarys():
    """The bench names flat_mean's defaults (its sweep skips that plan) without
    the private make_config; they must stay the library's."""
    from jaxsync._core._config import make_config
    from jaxsync.bench.methods import FLAT_DEFAULTS

    cfg = make_config("flat_mean", "flat", "d", None)
    assert FLAT_DEFAULTS == {"bucket_bytes": cfg.bucket_bytes, "pack_threshold": cfg.pack_threshold}


# The bench and the demo use jaxsync's public API; these private imports remain
# (each explained in its module's docstring).
_PRIVATE_ALLOWED = {
    ("compress.py", "jaxsync.auto._cost"),
    ("compress.py", "jaxsync.compress._common"),
    # the cost model's accuracy check: the model has no public API
    ("model.py", "jaxsync.auto._cost_ops"),
    ("model.py", "jaxsync.auto._auto"),
    ("model.py", "jaxsync._core._plan"),
    ("model.py", "jaxsync.auto._tune"),
    ("model.py", "jaxsync.auto._tune_tiers"),  # the cluster's shaped link, as tune reads it
    # host 0's address inside the emulated cluster (Spec.address)
    ("jaxdist.py", "jaxsync.cluster._spec"),
    # the timeline picture of the cluster and overlap suites: python -m jaxsync timeline's code
    ("report.py", "jaxsync._cli._timeline"),
    # the fake CPU device count before JAX starts, set as python -m jaxsync tune sets it
    ("world.py", "jaxsync._comm._topology"),
}


def test_bench_package_imports_only_public_jaxsync():
    found = set()
    for path in sorted((ROOT / "jaxsync" / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = ["jaxsync", "bench"][: max(0, 3 - node.level)] if node.level else []
                mod = ".".join(base + ([node.module] if node.module else []))
                # ``from pkg import name``: name may be a module of pkg
                mods = [f"{mod}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            else:
                continue
            for full in mods:
                parts = full.split(".")
                private = [i for i, p in enumerate(parts) if i and p.startswith("_")]
                if parts[:2] != ["jaxsync", "bench"] and parts[0] == "jaxsync" and private:
                    found.add((path.name, ".".join(parts[: private[-1] + 1])))
    assert found == _PRIVATE_ALLOWED, found ^ _PRIVATE_ALLOWED


def test_python_m_jaxsync_bench_help_and_unknown_suite():
    for cmd in (["jaxsync", "bench"], ["jaxsync.bench"]):
        proc = run_module(*cmd, "--help", timeout=60)
        assert proc.returncode == 0 and "--tune-host-allocator" in proc.stdout, proc.stderr
    proc = run_module("jaxsync", "bench", "--suite", "nosuch", timeout=60)
    assert proc.returncode == 1 and "unknown suite 'nosuch'" in proc.stderr, proc.stderr


def test_cpu_meter_adds_up_the_machines_busy_share():
    """``timing.CpuMeter``: /proc/stat's busy ticks over all ticks, over every block."""
    from jaxsync.bench import timing

    busy0, total0 = timing.cpu_ticks()
    assert 0 <= busy0 <= total0 and total0 > 0  # Linux: /proc/stat is there
    meter = timing.CpuMeter()
    for _ in range(2):
        with meter:
            t = timing.time.perf_counter()
            while timing.time.perf_counter() - t < 0.15:  # a busy loop: >= 1 core busy
                pass
    cores = os.cpu_count() or 1
    assert meter.wall_s >= 0.3 and meter.total > 0
    # a busy loop on one core; the machine is shared, so it may get less of one
    assert 0.1 / cores <= meter.machine <= 1.0, meter.machine
    assert 0.1 / cores <= meter.own <= 1.0 / cores + 0.1, meter.own
    machine, ranks = timing.ranks_share([meter, timing.CpuMeter()])
    assert machine[0] == round(meter.machine, 3) and ranks[0] == round(meter.own, 3)
    assert math.isnan(machine[1]) and math.isnan(ranks[1])  # nothing measured


def test_every_row_carries_its_cpu_share():
    from jaxsync.bench import timing

    cases = [
        timing.Case("base", "base", None),
        timing.Case("sync", "jaxsync", "base"),
        timing.Case("bare", "bare", "base"),
    ]
    samples = [[0.010, 0.030, 0.020]]
    rows = timing.make_rows(
        "mpi",
        "t",
        (1, 2, 8),
        cases,
        [1, 1, 1],
        samples,
        [[0, 0, 0]],
        cpu=([0.1, 0.9, 0.2], [0.05, 0.8, 0.1]),
    )
    assert [(r.method, r.cpu_busy, r.cpu_ranks) for r in rows] == [
        ("sync", 0.9, 0.8),
        ("bare", 0.2, 0.1),
    ]
    assert math.isnan(
        timing.make_rows("mpi", "t", (1, 2, 8), cases, [1] * 3, samples, [[0] * 3])[0].cpu_busy
    )


def test_cluster_table_has_the_cpu_share_beside_each_figure(tmp_path):
    from jaxsync.bench import cluster

    cfg = cluster.Config(2, 1, 1, "100mbit")
    rows = [
        dict(
            tree="t",
            method="hierarchical",
            kind="jaxsync",
            tree_bytes=10**6,
            ms=90.0,
            cpu_busy=0.21,
            cpu_scope="case",
        ),
        dict(
            tree="t",
            method="sign (compress suite)",
            kind="compress",
            tree_bytes=None,
            ms=9.0,
            step_ms=20.0,
            cpu_busy=0.8,
            cpu_scope="run",
        ),
        dict(tree="t", method="bare", kind="bare", tree_bytes=10**6, ms=95.0),
    ]
    res = dict(config=cluster.dataclasses.asdict(cfg), name=cfg.name, rate_bps=1e8, rows=rows)
    table, targets = cluster.summarise([res])
    cluster.write(tmp_path, [res], table, targets, {})
    md = (tmp_path / "cluster.md").read_text()
    assert "| ms | x link limit | CPU busy |" in md
    assert "| hierarchical | 90.0 | 1.12 | 21% |" in md
    assert "| 9.0 | 0.11 | 80% (run) |" in md and "| bare | 95.0 | 1.19 | - |" in md
    saved = json.loads((tmp_path / "cluster.json").read_text())["table"]
    assert [r.get("cpu_busy") for r in saved] == [0.21, 0.8, None]


def test_draw_timeline_merges_the_ranks_files_and_draws_them(tmp_path):
    from jaxsync.bench import report

    assert report.draw_timeline(tmp_path, tmp_path / "t.png") is None  # no files
    for rank in (0, 1):
        doc = {
            "traceEvents": [
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": rank,
                    "tid": 0,
                    "args": {"name": "steps"},
                },
                {
                    "ph": "X",
                    "cat": "step",
                    "name": "step 0",
                    "pid": rank,
                    "tid": 0,
                    "ts": 0,
                    "dur": 900,
                },
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": rank,
                    "tid": 1,
                    "args": {"name": "world"},
                },
                {
                    "ph": "X",
                    "cat": "communication",
                    "name": "allreduce",
                    "pid": rank,
                    "tid": 1,
                    "ts": 100,
                    "dur": 500,
                },
            ],
            "otherData": {"rank": rank},
        }
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(doc))
    got = report.draw_timeline(tmp_path, tmp_path / "t.png")
    assert got["png"] == str(tmp_path / "t.png") and (tmp_path / "t.png").stat().st_size > 0
    merged = json.loads((tmp_path / "timeline.json").read_text())
    assert len(merged["traceEvents"]) == 8
    assert got["summary"][1].startswith("rank 1: 1 calls, 1 steps, 0.5 ms in calls")


def test_collective_stats_counts_the_pipelined_tier():
    # the bench's wire column once crashed (KeyError: 'tier') on any step that took
    # jaxsync_tier: bf16 on the wire (host_tier="auto") on 2 hosts x 2 processes
    import jax
    import jax.numpy as jnp

    from jaxsync._comm import _native_prim, _ordering
    from jaxsync.bench.hlo import collective_stats

    if not _native_prim.tier_available():
        pytest.skip("the native library has no jaxsync_tier")

    def step(x, chunk):
        _, ys = _native_prim.native_call(
            "tier",
            [x],
            _ordering.chain_token(),
            jnp.zeros(2, jnp.int32),
            jnp.ones(2, jnp.int32),
            2,
            chunk=chunk,
        )
        return ys[0]

    x = jnp.zeros(1000, jnp.float32)  # 4,000 bytes, 2 processes a host, 2 hosts
    hier = jax.make_jaxpr(lambda x: step(x, 1 << 21))(x)
    assert collective_stats(hier.jaxpr, 1, 4) == (1, 4000 + 4000 + 4000)
    two_d = jax.make_jaxpr(lambda x: step(x, -(1 << 21)))(x)
    assert collective_stats(two_d.jaxpr, 1, 4) == (1, 2000 + 2000 + 2000)


class _RecordingComm:
    """A communicator of ``size`` ranks seen from ``rank``: records the transfers
    (every request completes at once)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size, self.calls = rank, size, []

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def Send(self, buf, dest, tag):
        self.calls.append(("send", dest))

    def Recv(self, buf, source, tag):
        self.calls.append(("recv", source))

    def Ibarrier(self):
        return types.SimpleNamespace(Test=lambda: True)

    def Iallreduce(self, sendbuf, recvbuf, op):
        return types.SimpleNamespace(Test=lambda: True)


def test_the_rate_probe_times_one_way_at_a_time():
    """A ``Sendrecv`` both ways at once sometimes ran its directions one after the
    other (the probe read 48 Mb/s on a 100 Mb/s link at 2 hosts x 4): the probe
    sends from rank 0 to the last rank, then back, never both at once."""
    import numpy as np

    from jaxsync.bench.cluster_inside import probe_rates

    buf = np.zeros(4, np.float32)
    first, last, other = _RecordingComm(0, 8), _RecordingComm(7, 8), _RecordingComm(3, 8)
    rates = [probe_rates(c, buf, rounds=3) for c in (first, last, other)]
    assert first.calls == [("send", 7), ("recv", 7)] * 4
    assert last.calls == [("recv", 0), ("send", 0)] * 4
    assert other.calls == []  # the ranks between them only wait
    assert [len(r) for r in rates] == [6, 6, 6]  # the first round each way is left out
    assert min(rates[0] + rates[1]) > 0

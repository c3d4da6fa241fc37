"""The cost model on a network (issue 25): the profile's tiers and topology,
the choice on the network link, ``auto_mean(allow_lossy=...)`` and ``tune
--project --profile``. The calibration inside the emulated cluster is in
``tests/cluster/test_cluster_tune.py``."""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsync
from jaxsync.auto import _auto, _cost, _project, _tune_tiers
from jaxsync.auto._cost import Link, Profile
from jaxsync.auto._cost_ops import ModelTopology

ROOT = Path(__file__).resolve().parent.parent
GBIT = Link(alpha=50e-6, beta=8e-9, gamma=0.3e-9, algorithm="ring")  # 1 Gb/s
SHM = Link(alpha=10e-6, beta=0.1e-9, gamma=0.3e-9, algorithm="ring")


def _measured_profile() -> Profile:
    return Profile(
        (("host", SHM), ("network", GBIT)),
        0.2e-9,
        {
            "processes": 4,
            "hosts": 2,
            "local_devices": 1,
            "per_host": 2,
            "host_tier": False,
            "measured": {"host": "the 2 processes of each host", "network": "one per host"},
            "cluster": {"link": "1gbit", "rate_bps": 1e9, "hosts": 2, "procs_per_host": 2},
        },
        "calibrated",
        overheads=(("flat", (1e-6, -1e-10)),),
    )


def test_profile_round_trips_tiers_and_topology():
    prof = _measured_profile()
    back = Profile.from_json(json.loads(json.dumps(prof.to_json())), "p.json")
    assert back.links == prof.links and back.topology == prof.topology
    assert back.link("network") == GBIT and back.link("host") == SHM
    assert back.missing() == ["device"] and back.digest() == prof.digest()


def test_cross_host_stages_are_priced_on_the_network_link():
    tree = {"w": jax.ShapeDtypeStruct((2**20,), jnp.float32)}  # 4 MiB
    prof = _measured_profile()
    h = ("hierarchical",)  # (flat has a fitted overhead in this profile)
    one_host = _auto.choose(tree, ModelTopology(processes=2, hosts=1), prof, strategies=h)
    two_hosts = _auto.choose(tree, ModelTopology(processes=2, hosts=2), prof, strategies=h)
    # ring allreduce of 4 MiB between 2: n beta + n/2 gamma (+ alpha, call); across
    # hosts the native target sums it in 8 pieces of 512 KiB, two in flight: each
    # further piece adds half a 1-byte allreduce's latency
    n = 4 * 2**20
    lat = 2 * GBIT.alpha + GBIT.beta + GBIT.gamma / 2
    whole = 2 * GBIT.alpha + n * GBIT.beta + n / 2 * GBIT.gamma
    assert two_hosts.seconds == pytest.approx(whole + 7 * lat / 2)
    assert one_host.seconds == pytest.approx(2 * SHM.alpha + n * SHM.beta + n / 2 * SHM.gamma)
    assert "inter link network" in two_hosts.describe()


def test_host_tier_uses_both_measured_links():
    tree = {"w": jax.ShapeDtypeStruct((2**20,), jnp.float32)}
    prof = _measured_profile()
    topo = ModelTopology(processes=4, hosts=2, host_tier=True)
    c = _auto.choose(tree, topo, prof, strategies=("hierarchical",))
    # the host's reduce and broadcast on shared memory, the leaders' allreduce on
    # the network: slower than shared memory alone, faster than 1.5x the network
    n = 4 * 2**20
    assert n * GBIT.beta < c.seconds < n * GBIT.beta + 4 * n * SHM.beta + 1e-3


def test_cluster_link_reads_the_clusters_spec(monkeypatch):
    monkeypatch.setenv(
        "JAXSYNC_CLUSTER", json.dumps({"hosts": 2, "procs_per_host": 1, "link": "10gbit"})
    )
    got = _tune_tiers.cluster_link()
    assert got == {"link": "10gbit", "hosts": 2, "procs_per_host": 1, "rate_bps": 1e10}
    monkeypatch.setenv("JAXSYNC_CLUSTER", "not json")
    assert _tune_tiers.cluster_link() is None


# --------------------------------------------------------------------------
# allow_lossy
# --------------------------------------------------------------------------


def test_allow_lossy_validated_when_the_factory_is_called():
    with pytest.raises(TypeError, match="'allow_lossy'"):
        jaxsync.auto_mean(axis_name="i", comm=None, allow_lossy="bfloat16")
    with pytest.raises(ValueError, match="allow_lossy must name wire dtypes"):
        jaxsync.auto_mean(axis_name="i", comm=None, allow_lossy=("int8",))
    with pytest.raises(ValueError, match="powersgd cannot be chosen at trace time"):
        jaxsync.auto_mean(axis_name="i", comm=None, allow_lossy=("bfloat16", "powersgd"))
    with pytest.raises(ValueError, match="comm_dtype"):
        jaxsync.auto_mean(axis_name="i", comm=None, allow_lossy=True, comm_dtype=jnp.bfloat16)
    tx = jaxsync.auto_mean(axis_name="i", comm=None, allow_lossy=["float16", "bfloat16"])
    assert tx.update.config.auto.lossy == ("bfloat16", "float16")


def test_lossy_wire_only_when_allowed_and_faster():
    tree = {"w": jax.ShapeDtypeStruct((2**20,), jnp.float32)}
    prof = _measured_profile()
    topo = ModelTopology(processes=2, hosts=2)
    plain = _auto.choose(tree, topo, prof)
    assert plain.comm_dtype is None and all(row[4] is None for row in plain.table)
    lossy = _auto.choose(tree, topo, prof, lossy=("bfloat16",))
    assert lossy.comm_dtype == "bfloat16" and lossy.seconds < 0.6 * plain.seconds
    assert lossy == _auto.choose(tree, topo, prof, lossy=("bfloat16",))  # deterministic
    text = lossy.describe()
    assert "comm_dtype bfloat16 (lossy)" in text and "lossy allowed: bfloat16" in text
    assert "lossy allowed: none" in plain.describe()
    # where 16 bits cost more than they save (a fast link, a costly conversion),
    # the lossless pick stays
    slow16 = Profile(
        (("network", SHM),),
        0.2e-9,
        overheads16=tuple((k, 5e-9) for k in ("flat", "hierarchical", "naive", "two_dimensional")),
    )
    assert _auto.choose(tree, topo, slow16, lossy=("bfloat16",)).comm_dtype is None


def test_auto_mean_allowed_bfloat16_runs_and_describes():
    # one process: no wire, so bf16 is never faster; the choice records what was allowed
    tx = jaxsync.auto_mean(axis_name="i", comm=None, allow_lossy=True)
    g = {"w": jnp.arange(8.0)}
    out = jax.vmap(lambda t: tx.update(t, tx.init(t))[0], axis_name="i")(g)
    np.testing.assert_array_equal(np.asarray(out["w"]), np.full(8, 3.5, np.float32))
    assert "lossy allowed: bfloat16" in tx.describe()


def test_resolve_puts_the_chosen_wire_dtype_in_the_config(monkeypatch):
    tx = jaxsync.auto_mean(axis_name="i", comm=None, profile=_measured_profile(), allow_lossy=True)
    cfg = tx.update.config
    real = _auto.ModelTopology

    def two_hosts(**kw):  # as if the backend spanned two hosts over the network
        return real(**{**kw, "processes": 2, "hosts": 2, "native": True, "inter_link": None})

    monkeypatch.setattr(_auto, "ModelTopology", two_hosts)
    seen = []

    def step(t):
        seen.append(_auto.resolve({"w": t}, cfg))
        return t

    with warnings.catch_warnings():  # (notes: no device link, another topology)
        warnings.simplefilter("ignore")
        jax.vmap(step, axis_name="i")(jnp.zeros((2, 2**20)))
    assert seen[0].comm_dtype == "bfloat16" and seen[0].strategy != "auto"
    assert "comm_dtype bfloat16 (lossy)" in tx.describe()


# --------------------------------------------------------------------------
# tune --project --profile
# --------------------------------------------------------------------------


def test_measured_projection_says_what_is_measured():
    prof = _measured_profile()
    merged, devices, figures = _project.measured_projection(prof, "p.json")
    how = {f: h for f, _, h in figures}
    assert how["network link"] == "measured (profile p.json)"
    assert how["device link"] == "assumed" and how["devices per host"] == "assumed"
    assert how["copy"] == how["strategy overheads"] == "measured (profile p.json)"
    assert merged.link("network") == GBIT and merged.overheads == prof.overheads
    assert devices == 8
    rows = _project.project(hosts=(8,), devices=devices, profiles={"m": merged}, native=True)
    assert {r["network"] for r in rows} == {"m"}
    # nothing measured: every figure assumed
    _, _, figures = _project.measured_projection(_cost.DEFAULT_PROFILE, "x")
    assert {h for *_, h in figures} == {"assumed"}


def test_tune_project_with_a_profile_cli(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_measured_profile().to_json()))
    env = {"PYTHONPATH": str(ROOT), "PATH": str(Path(sys.executable).parent), "HOME": str(tmp_path)}
    run = [sys.executable, "-m", "jaxsync", "tune", "--project", "--profile", str(path)]
    r = subprocess.run(run, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"measured (profile {path})" in r.stdout and "assumed" in r.stdout
    assert "| measured (p.json) |" in r.stdout
    r = subprocess.run([*run, "--json"], env=env, capture_output=True, text=True, timeout=240)
    got = json.loads(r.stdout)
    src = {f["figure"]: f["source"] for f in got["figures"]}
    assert src["network link"].startswith("measured") and src["device link"] == "assumed"
    r = subprocess.run(
        [sys.executable, "-m", "jaxsync", "tune", "--project", "--profile", str(tmp_path / "no")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode != 0 and "does not exist" in r.stderr


def test_model_report_puts_each_configurations_noise_floor_beside_the_model(tmp_path):
    from jaxsync.bench.model_report import collect

    def run(folder, cfg, measured, load):
        strategies = {
            s: {"measured_ms": m, "predicted_ms": 1.0, "q25_ms": m, "q75_ms": m}
            for s, m in zip(("naive", "flat", "hierarchical", "two_dimensional"), measured)
        }
        auto = {"choice": "flat", "measured_ms": measured[1], "best": "flat", "ok": True}
        body = {
            "config": cfg,
            "meta": {"host_allocator": "tuned", "loadavg": [load, 0.0, 0.0]},
            "trees": [{"tree": "t", "strategies": strategies, "auto": auto | {"best_ms": 1.0}}],
        }
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"model-{cfg}.json").write_text(json.dumps(body))

    run(tmp_path, "2x1x1@1gbit", [1.0, 1.0, 1.0, 1.0], 3.0)
    run(tmp_path, "2x2x1@1gbit", [1.0, 2.0, 1.0, 1.0], 9.0)
    run(tmp_path / "repeat", "2x1x1@1gbit", [1.0, 1.1, 2.0, 1.0], 3.0)
    run(tmp_path / "repeat", "2x2x1@1gbit", [1.0, 2.0, 1.0, 1.0], 9.0)
    rows = {r["config"]: r for r in collect(tmp_path)["per_config"]}
    a, b = rows["2x1x1@1gbit"], rows["2x2x1@1gbit"]
    assert (a["model_within_25pct"], a["repeat_within_25pct"]) == (1.0, 0.75)
    assert (b["model_within_25pct"], b["repeat_within_25pct"]) == (0.75, 1.0)
    assert a["model_within_25pct_of_repeat"] == 0.75 and a["loadavg"][0] == 3.0
    text = (tmp_path / "model.md").read_text()
    assert "| 2x1x1@1gbit | 4 | 100% | 75% | 75% | 100% | 100% | 3.0 |" in text

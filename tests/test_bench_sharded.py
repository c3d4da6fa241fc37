"""Smoke test of ``python -m jaxsync bench --suite sharded`` (one process, 4 fake
devices, the tiny tree, one round): it runs through the ``--suite`` dispatch and
writes its JSON with every field, and the optimizer state's bytes per device,
measured from the arrays, are exactly those of the inner state of one replica's
slices (``ceil(n/4)`` of each leaf), about 1/4 of the chain's. Speed is not
asserted."""

import json
import math

from _bench import run_module

from jaxsync.bench import sharded as bs


def test_slices_and_hlo_counts():
    import jax
    import jax.numpy as jnp

    s = bs.slice_struct(jax.ShapeDtypeStruct((64, 32), jnp.float32), 8)
    assert s.shape == (1, 256)  # docs/sharded.md: the leaf's rank kept
    assert bs.slice_struct(jax.ShapeDtypeStruct((5,), jnp.float32), 4).shape == (2,)
    text = "  %copy.1 = f32[4] copy(%p)\n  %ar = f32[4] all-reduce-start(%x)\n %y = fusion(%a)"
    assert bs.hlo_ops(text) == {
        "copy": 1, "fusion": 1, "all-reduce": 1, "reduce-scatter": 0, "all-gather": 0,
        "custom-call": 0,
    }  # fmt: skip


def test_quick_sharded_suite_writes_json(tmp_path):
    extra = tmp_path / "copy.json"
    cmd = ["jaxsync", "bench", "--suite", "sharded", "--quick"]
    cmd += ["--trees", "tiny", "--devices", "4", "--rounds", "1", "--iters", "1"]
    cmd += ["--out", str(tmp_path), "--json", str(extra)]
    proc = run_module(*cmd, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "sharded-intra.json").read_text())
    assert json.loads(extra.read_text()) == result
    assert (tmp_path / "sharded-intra.png").exists() or "no plot" in proc.stdout
    meta = result["meta"]
    assert (meta["mode"], meta["processes"], meta["devices"]) == ("intra", 1, 4)
    (row,) = result["rows"]
    assert (row["tree"], row["optimizer"], row["replicas"]) == ("tiny", "adam", 4)
    timed = {"chain", "sharded", "bare allreduce", "bare rs+ag", "update whole", "update slice"}
    assert set(row["median_ms"]) == timed == set(row["cpu_busy"])
    assert all(math.isfinite(v) and v > 0 for v in row["median_ms"].values())
    assert math.isfinite(row["step_ratio"]) and math.isfinite(row["update_ratio"])
    # memory: measured bytes are the inner state's, whole (chain) and of the slices
    assert row["state_bytes"] == row["expected_bytes"]
    sizes = [12 * 24, 24] * 3  # tiny: 3 layers of a (12, 24) kernel and a (24,) bias
    assert row["params"] == sum(sizes)
    assert row["layout_ratio"] == sum(-(-n // 4) for n in sizes) / sum(sizes) == 0.25
    moments = 2 * 4 * row["params"]  # adam's mu and nu, float32
    assert row["state_bytes"]["chain"] == moments + 4  # and the int32 count
    assert row["state_bytes"]["sharded"] == moments // 4 + 4
    assert row["state_ratio"] == row["state_bytes"]["sharded"] / row["state_bytes"]["chain"]
    for k in ("chain", "sharded"):
        assert set(row["step_memory"][k]) >= {"temp", "argument", "output", "alias"}
        assert set(row["hlo_ops"][k]) == set(bs.HLO_OPS)
    assert row["hlo_ops"]["sharded"]["reduce-scatter"] >= 1
    assert row["hlo_ops"]["sharded"]["all-gather"] >= 1
    state = [t for t in result["targets"] if "state bytes" in t["what"]]
    assert len(state) == 1 and state[0]["ok"], result["targets"]

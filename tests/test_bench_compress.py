"""Smoke test of ``python -m jaxsync bench --suite compress --quick`` (one process).

Checks that it runs through the ``--suite`` dispatch and writes its JSON, that
the byte counts follow the transforms' layouts (compressed payloads smaller than
the uncompressed one), and that every figure is finite. Speed is not asserted.
"""

import json
import math

from _bench import run_module

from jaxsync.bench import compress as bc


def test_ring_model_closed_form():
    # 4 members, 1 MB, 8 Gb/s (1 GB/s), alpha 0: allreduce 2*3/4 MB, allgather 3 MB
    assert math.isclose(bc.ring_time("allreduce", 1e6, 4, 8.0, alpha=0.0), 1.5e-3)
    assert math.isclose(bc.ring_time("allgather", 1e6, 4, 8.0, alpha=0.0), 3e-3)
    assert bc.ring_time("allreduce", 1e6, 1, 8.0) == 0.0
    assert math.isclose(bc.ring_time("allgather", 0.0 + 1, 3, 8.0, alpha=1.0), 2 * (1.0 + 1e-9))


def test_payloads_of_resnet_like_tree():
    from jaxsync.bench.trees import resnet18_like

    tree = resnet18_like()
    full = sum(b for _, b in bc.payloads("hierarchical", tree))
    psgd = sum(b for _, b in bc.payloads("powersgd r4", tree))
    sign = sum(b for _, b in bc.payloads("sign", tree))
    assert full == 4 * 5_502_728  # every leaf float32
    assert full / psgd >= 20, full / psgd  # the target for rank 4
    assert 25 <= full / sign <= 32, full / sign


def test_quick_compress_suite_writes_json(tmp_path):
    proc = run_module(
        "jaxsync", "bench", "--suite", "compress", "--quick", "--out", tmp_path, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "compress-local.json").read_text())
    rows = {r["sync"]: r for r in result["rows"]}
    assert set(rows) == set(bc.SYNCS)
    for r in rows.values():
        assert math.isfinite(r["marginal_ms"]) and r["payload_bytes"] > 0
        assert all(math.isfinite(v) for v in r["modelled_ms"].values())
    assert rows["hierarchical"]["bytes_ratio"] == 1.0
    for name in ("powersgd r4", "powersgd r1", "sign", "int8", "int4"):
        assert rows[name]["payload_bytes"] < rows["hierarchical"]["payload_bytes"]
    for name, bits in (("int8", 8), ("int4", 4)):  # n (b / 8 + 4 / B) of n float32 values
        n = rows["hierarchical"]["payload_bytes"] // 4
        want = -(-n * bits // 8) + 4 * -(-n // 2048)
        assert rows[name]["payload_bytes"] == want

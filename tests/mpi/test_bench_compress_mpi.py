"""``python -m jaxsync bench --suite compress --quick`` under ``mpirun -n 2``: it
runs the README's step with every compressor (the 8- and 4-bit wires too) over
MPI, times the bare mpi4py collectives of the same payloads, and writes
compress-mpi.json. Figures are not checked (speed is never asserted)."""

import json
import math

from mpi_harness import requires_mpi, run_bench

pytestmark = requires_mpi


def test_compress_suite_under_mpirun(tmp_path):
    args = ["--suite", "compress", "--quick", "--out", tmp_path]
    returncode, text, timed_out = run_bench(args, timeout=400)
    if timed_out:
        raise AssertionError("compress bench under mpirun timed out:\n" + text[-3000:])
    assert returncode == 0, text[-3000:]
    result = json.loads((tmp_path / "compress-mpi.json").read_text())
    assert result["meta"]["processes"] == 2
    rows = {r["sync"]: r for r in result["rows"]}
    assert set(rows) == {"hierarchical", "powersgd r4", "powersgd r1", "sign", "int8", "int4"}
    for r in rows.values():
        assert math.isfinite(r["marginal_ms"]) and math.isfinite(r["bare_ms"]), r
        assert r["bare_ms"] > 0, r

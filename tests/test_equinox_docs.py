"""docs/equinox.md's code runs, in order, in one fresh process, each block quickly.

As tests/test_flax_docs.py does for the Flax page (its extraction and runner: 8 fake CPU
devices, no MPI launcher), with the page's own checks printed and the names the page
exists to show present in its code. tests/mpi/test_equinox_docs_mpi.py runs it under
``mpirun``.
"""

from __future__ import annotations

import json
from pathlib import Path

from test_flax_docs import BLOCK_LIMIT_S, blocks, run_page

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "equinox.md"


def test_equinox_page_runs_in_order_and_checks_itself():
    r = run_page(PAGE.read_text(), page="docs/equinox.md")
    assert r.returncode == 0, f"a block of docs/equinox.md failed\n{r.stdout}\n{r.stderr}"
    times = json.loads(r.stdout.split("TIMES ", 1)[1])
    slow = [(line, round(s, 1)) for line, s in times if s > BLOCK_LIMIT_S]
    assert not slow, f"docs/equinox.md blocks (line, seconds) too slow: {slow}"
    assert "replicas bit-identical: True" in r.stdout
    assert "largest difference from one device: " in r.stdout


def test_equinox_page_shows_the_recipe():
    bs = blocks(PAGE.read_text())
    assert sum(b["run"] for b in bs) >= 6, "the extraction found (almost) nothing to run"
    assert all(b["reason"] for b in bs if not b["run"])
    code = "".join(b["source"] for b in bs if b["run"])
    for name in (
        "eqx.partition(model, eqx.is_array)",
        "eqx.combine(params, static)",
        "eqx.filter_value_and_grad",
        "eqx.filter_jit",
        "jax.shard_map",
        "jaxsync.broadcast_params(params)",
        "tx.init(params)",
        "jaxsync.state_specs(jax.eval_shape(tx.init, params)",
        "jaxsync.replica_mean",
        "jaxsync.powersgd_mean(",
        "optax.adamw",
        "ocp.StandardCheckpointer",
        'f"rank{RANK}"',
    ):
        assert name in code, f"docs/equinox.md's code no longer shows {name}"
    assert ".describe(params)" in "".join(b["source"] for b in bs)

"""docs/flax.md's code runs: every ```python block, in order, in one fresh process.

As the docs test will (8 fake CPU devices, no MPI launcher in the environment): a
block may use what an earlier block defined; a block that needs ``mpirun`` is
preceded by ``<!-- not run: REASON -->`` and skipped. Each block must also be
quick (the page is documentation, not a benchmark): the runner times them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "flax.md"
TIMEOUT_S = 300
BLOCK_LIMIT_S = 60  # generous for a loaded 2-core machine; each takes a few seconds

_FENCE = re.compile(r"^```+\s*([\w-]*)\s*$")
_MARKER = re.compile(r"<!--\s*not run:\s*(\S.*?)-->")


def blocks(text: str) -> list[dict]:
    """``{"line", "source", "run", "reason"}`` for each ```python block."""
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = _MARKER.search(lines[k]) if k >= 0 else None
        if m.group(1) in ("python", "py"):
            out.append(
                dict(
                    line=i + 2,
                    source="\n".join(lines[i + 1 : j]) + "\n",
                    run=marker is None,
                    reason=marker.group(1).strip() if marker else "",
                )
            )
        i = j + 1
    return out


_RUNNER = """
import json, sys, time
import jax
jax.config.update("jax_num_cpu_devices", 8)
ns = {"__name__": "__main__"}
times = []
for b in json.loads(sys.stdin.read()):
    t = time.perf_counter()
    exec(compile("\\n" * (b["line"] - 1) + b["source"], b["page"], "exec"), ns)
    times.append((b["line"], time.perf_counter() - t))
print("TIMES " + json.dumps(times))
"""


def run_page(text: str, page: str = "docs/flax.md") -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "XLA_FLAGS"
        and not k.startswith(("PMI_", "OMPI_", "PMIX_", "MPI_LOCALNRANKS", "HYDRA_"))
    }
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    payload = [dict(b, page=page) for b in blocks(text) if b["run"]]
    return subprocess.run(
        [sys.executable, "-c", _RUNNER],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=ROOT,
        env=env,
    )


def test_flax_page_runs_in_order():
    r = run_page(PAGE.read_text())
    assert r.returncode == 0, f"a block of docs/flax.md failed\n{r.stdout}\n{r.stderr}"
    times = json.loads(r.stdout.split("TIMES ", 1)[1])
    slow = [(line, round(s, 1)) for line, s in times if s > BLOCK_LIMIT_S]
    assert not slow, f"docs/flax.md blocks (line, seconds) too slow: {slow}"


def test_flax_page_has_runnable_and_marked_blocks():
    bs = blocks(PAGE.read_text())
    assert sum(b["run"] for b in bs) >= 5, "the extraction found (almost) nothing to run"
    assert all(b["reason"] for b in bs if not b["run"])


def test_a_failing_block_fails_and_points_at_the_page():
    text = "```python\nx = 1\n```\n\n<!-- not run: demo -->\n```python\nboom\n```\n\n"
    text += "```python\nassert x == 2, 'caught'\n```\n"
    r = run_page(text, page="page.md")
    assert r.returncode != 0 and "caught" in r.stderr and 'page.md", line 11' in r.stderr

"""The documentation's code: every ```python block of README.md and docs/*.md runs.

Each page's blocks run in order, in one fresh Python process per page (so a block may
use what an earlier block of its page defined), with 8 fake CPU devices and no MPI
launcher. A block that cannot run here (it needs mpirun, a GPU, a cluster) is
preceded by ``<!-- not run: REASON -->``; the reason must be given. Shell blocks
(bash, sh, console) are never run. The API page must name every public name.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT_S = 300  # per page; the slowest page compiles a few small steps

_FENCE = re.compile(r"^(?P<indent>[ ]*)(?P<fence>```+)\s*(?P<lang>[\w-]*)")
_MARKER = re.compile(r"<!--\s*not run\b(?P<colon>:?)(?P<reason>.*?)-->", re.S)


@dataclass
class Block:
    page: str
    line: int  # 1-based line of the block's first code line
    lang: str
    source: str
    marker: str | None  # the not-run comment right before the fence, if any
    reason: str  # its reason ("" when missing)


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a page, with the not-run comment before each."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group("indent"), m.group("fence"), m.group("lang").lower()
        start = i + 1
        j = start
        while j < len(lines) and lines[j].strip() != fence:
            j += 1
        body = [
            ln[len(indent) :] if ln.startswith(indent) else ln.lstrip() for ln in lines[start:j]
        ]
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = reason = None
        if k >= 0 and (mm := _MARKER.search(lines[k])):
            marker = lines[k].strip()
            reason = mm.group("reason").strip() if mm.group("colon") else ""
        out.append(
            Block(
                page=path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name,
                line=start + 1,
                lang=lang,
                source="\n".join(body) + "\n",
                marker=marker,
                reason=reason or "",
            )
        )
        i = j + 1
    return out


def runnable(path: Path) -> list[Block]:
    return [b for b in blocks(path) if b.lang in ("python", "py") and b.marker is None]


# Runs a page's blocks in one namespace; each block is compiled under the page's name
# and its own line numbers, so a traceback points into the page.
_RUNNER = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
ns = {"__name__": "__main__"}
for b in json.loads(sys.stdin.read()):
    exec(compile("\\n" * (b["line"] - 1) + b["source"], b["page"], "exec"), ns)
"""

_LAUNCHER_VARS = ("PMI_", "OMPI_", "PMIX_", "MPI_LOCALNRANKS", "SLURM_", "HYDRA_")


def run_blocks(bs: list[Block]) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "XLA_FLAGS" and not k.startswith(("MALLOC_", *_LAUNCHER_VARS))
    }
    env["JAX_PLATFORMS"] = "cpu"
    payload = json.dumps([{"page": b.page, "line": b.line, "source": b.source} for b in bs])
    return subprocess.run(
        [sys.executable, "-c", _RUNNER],
        input=payload,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=ROOT,
        env=env,
    )


# Pages whose blocks a test of their own runs the same way, in order, in one fresh
# process, and checks further (block times, what the page prints): run once, there.
OWN_TEST = {"docs/flax.md": "test_flax_docs.py", "docs/equinox.md": "test_equinox_docs.py"}


def test_pages_with_a_test_of_their_own_are_run_there_the_same_way():
    from test_flax_docs import blocks as own_blocks

    for page, test in OWN_TEST.items():
        assert (ROOT / "tests" / test).read_text().count("run_page(") >= 1, test
        text = (ROOT / page).read_text()
        own = [b["source"] for b in own_blocks(text) if b["run"]]
        assert own == [b.source for b in runnable(ROOT / page)], page


@pytest.mark.parametrize(
    "page",
    [p for p in PAGES if runnable(p) and p.relative_to(ROOT).as_posix() not in OWN_TEST],
    ids=lambda p: p.relative_to(ROOT).as_posix(),
)
def test_page_code_runs(page):
    r = run_blocks(runnable(page))
    assert r.returncode == 0, f"{page.name}: a code block failed\n{r.stdout}\n{r.stderr}"


def test_every_not_run_block_says_why():
    bad = []
    for page in PAGES:
        text = page.read_text()
        bs = blocks(page)
        attached = [b for b in bs if b.marker is not None]
        bad += [
            f"{b.page}:{b.line}: {b.marker!r} gives no reason" for b in attached if not b.reason
        ]
        markers = len(_MARKER.findall(text))
        if markers != len(attached):
            bad.append(f"{page.name}: a not-run comment is not right before a code block")
    assert not bad, "\n".join(bad)


def test_the_pages_have_code_that_runs():
    # The extraction itself: a page that should have runnable code has some, so an
    # extraction that found nothing cannot pass the test above by running nothing.
    for name in ("README.md", "docs/getting-started.md", "docs/compression.md"):
        assert runnable(ROOT / name), f"no runnable python block found in {name}"


def test_a_broken_block_fails(tmp_path):
    # The runner can fail: a later block sees an earlier one's names, and an error
    # points at the page's own line.
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n\n```python\nassert x == 2, 'caught'\n```\n")
    r = run_blocks(runnable(page))
    assert r.returncode != 0
    assert "caught" in r.stderr and 'page.md", line 6' in r.stderr, r.stderr


def test_api_page_names_every_public_name():
    import jaxsync

    text = (ROOT / "docs" / "api.md").read_text()
    entries = re.findall(r"^::: (\S+)\s*$", text, re.M)
    missing = [n for n in jaxsync.__all__ if f"jaxsync.{n}" not in entries]
    assert not missing, f"docs/api.md has no '::: jaxsync.NAME' entry for {missing}"
    assert len(entries) == len(set(entries)), "an API entry is listed twice"
    import importlib

    for entry in entries:  # and every entry is a public name that exists
        mod, _, name = entry.rpartition(".")
        assert hasattr(importlib.import_module(mod), name), f"{entry} does not exist"
        assert not any(part.startswith("_") for part in entry.split(".")), entry


# A private module or name of the package: jaxsync._core, jaxsync.sparse._rows,
# jaxsync/_comm/..., from jaxsync.sparse import _rows.
PRIVATE = re.compile(r"jaxsync(?:[./]\w+)*[./]_[a-z]|from jaxsync[\w.]* import .*\b_[a-z]")


def test_docs_name_public_modules_only():
    # The package's internal modules move; the pages (but the layout) and the
    # notebooks name public names. No page names a commit either: the JSON files
    # carry their provenance.
    bad = []
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
            for line in "".join(cell["source"]).splitlines():
                if PRIVATE.search(line):
                    bad.append(f"{nb.name}: cell {i}: {line.strip()}")
    for page in PAGES:
        if page.name == "layout.md":
            continue
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if PRIVATE.search(line) or "DESIGN.md" in line:
                bad.append(f"{page.name}:{n}: {line.strip()}")
            if re.search(r"commit `[0-9a-f]{7,}`", line):
                bad.append(f"{page.name}:{n}: names a commit: {line.strip()}")
    assert not bad, "\n".join(bad)


def _anchors(page: Path) -> set[str]:
    # Python-Markdown's toc slugs: lower case, punctuation dropped, spaces to dashes.
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)  # not code
    heads = re.findall(r"^#+ (.+?)\s*$", text, re.M)
    return {re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", h.lower()).strip()) for h in heads}


def test_readme_links_resolve():
    # mkdocs --strict checks the links between docs pages; the README is not one.
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", (ROOT / "README.md").read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = ROOT / path if path else ROOT / "README.md"
        if not file.exists():
            bad.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            bad.append(f"{target}: no heading #{anchor}")
    assert not bad, "README links that lead nowhere:\n" + "\n".join(bad)


def test_quickstart_is_the_same_on_both_pages():
    # The README's quickstart is repeated on the getting-started page; keep them one.
    def quickstart(page: str) -> str:
        return next(b.source for b in runnable(ROOT / page) if "broadcast_params" in b.source)

    assert quickstart("README.md") == quickstart("docs/getting-started.md")


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb")))
def test_notebooks_are_stored_executed(name):
    """A reader sees the tables and plots without running them (the suite re-runs
    them through nbmake, without writing back)."""
    nb = json.loads((ROOT / "notebooks" / name).read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    unrun = [i for i, c in enumerate(code) if c.get("execution_count") is None]
    assert not unrun, f"{name}: code cells {unrun} stored without being run"
    assert any(c.get("outputs") for c in code), f"{name}: stored without any output"
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{name}: stored with an error output"

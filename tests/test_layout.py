"""The package's layout: the README's "Layout" section lists every module of
``jaxsync/`` (one line each, nothing that is not there), and no module grows
past the size the layout is meant to keep readable."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 420  # "about 400": a module beyond this wants splitting by concern


def _modules() -> set[str]:
    return {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "jaxsync").rglob("*.py")
        if "__pycache__" not in p.parts
    }


def _layout_lines() -> list[str]:
    text = (ROOT / "docs" / "layout.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    return [line for line in block.splitlines() if line.strip()]


def test_readme_layout_lists_every_module_once():
    listed = [
        m.group(0) for line in _layout_lines() for m in [re.match(r"jaxsync/\S+\.py", line)] if m
    ]
    assert len(listed) == len(set(listed)), "a module is listed twice"
    missing = sorted(_modules() - set(listed))
    extra = sorted(set(listed) - _modules())
    assert not missing, f"README Layout does not list {missing}"
    assert not extra, f"README Layout lists modules that do not exist: {extra}"


def test_every_module_opens_with_a_docstring():
    import ast

    bare = [
        m
        for m in sorted(_modules())
        if ast.get_docstring(ast.parse((ROOT / m).read_text())) is None
        and (ROOT / m).read_text().strip()
    ]
    assert not bare, f"modules without an opening docstring: {bare}"


def test_no_module_is_too_long():
    long = {
        m: n
        for m in sorted(_modules())
        if (n := len((ROOT / m).read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"

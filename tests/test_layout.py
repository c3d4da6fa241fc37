"""The package's layout: the docs' layout page (docs/layout.md) lists every module
of ``jaxsync/`` (one line each, naming its concept, nothing that is not there),
every folder of the package is a package with a docstring and a README. The rule
is one concept per module (docs/layout.md), not a line count (issue 52, item 3)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


def test_layout_page_lists_every_module_once():
    listed = [
        m.group(0) for line in _layout_lines() for m in [re.match(r"jaxsync/\S+\.py", line)] if m
    ]
    assert len(listed) == len(set(listed)), "a module is listed twice"
    missing = sorted(_modules() - set(listed))
    extra = sorted(set(listed) - _modules())
    assert not missing, f"docs/layout.md does not list {missing}"
    assert not extra, f"docs/layout.md lists modules that do not exist: {extra}"


def test_every_module_opens_with_a_docstring():
    import ast

    bare = [
        m
        for m in sorted(_modules())
        if ast.get_docstring(ast.parse((ROOT / m).read_text())) is None
        and (ROOT / m).read_text().strip()
    ]
    assert not bare, f"modules without an opening docstring: {bare}"


def test_every_module_names_its_concept_once():
    concepts: dict[str, str] = {}
    for line in _layout_lines():
        m = re.match(r"(jaxsync/\S+\.py)\s+(.*)$", line)
        if m is None:
            continue
        module, concept = m.groups()
        assert len(concept.split()) >= 2, f"docs/layout.md: {module} names no concept"
        assert concept not in concepts, f"{module} and {concepts[concept]} say the same"
        concepts[concept] = module
    assert concepts, "no module lines found: the layout block moved?"


def test_every_subpackage_has_a_readme_that_places_it():
    folders = sorted(
        p
        for p in (ROOT / "jaxsync").iterdir()
        if p.is_dir() and (p / "__init__.py").exists() and p.name != "__pycache__"
    )
    assert len(folders) >= 8
    for folder in folders:
        readme = folder / "README.md"
        assert readme.exists(), f"{folder.relative_to(ROOT)} has no README.md"
        text = readme.read_text()
        rel = folder.relative_to(ROOT).as_posix()
        assert text.startswith(f"# {rel}"), f"{rel}/README.md opens with '# {rel}'"
        assert "docs/layout.md" in text, f"{rel}/README.md points to docs/layout.md"


def test_every_folder_of_the_package_is_a_package():
    folders = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "jaxsync").rglob("*")
        if p.is_dir() and "__pycache__" not in p.parts
    }
    bare = sorted(f for f in folders if not (ROOT / f / "__init__.py").exists())
    assert not bare, f"folders without an __init__.py: {bare}"

"""The package's import graph: no module imports another in a circle (at the top
or inside a function), the inter-process stage never imports the core, and the
core never imports an optional area (``sparse`` and ``auto`` plug in through
``jaxsync/_core/_plugins.py``). Imports under ``if TYPE_CHECKING:`` are
annotations only and do not count."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = (
    "jaxsync.sparse",
    "jaxsync.compress",
    "jaxsync.auto",
    "jaxsync.bench",
    "jaxsync.cluster",
    "jaxsync.zero",
    "jaxsync.local",
    "jaxsync.elastic",
)


def _modules() -> dict[str, Path]:
    mods = {}
    for p in (ROOT / "jaxsync").rglob("*.py"):
        if "__pycache__" in p.parts:
            continue
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the jaxsync modules it imports (anywhere in it)."""
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree)
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                # ``from pkg import name``: name may be a module of pkg
                targets = [
                    f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names
                ]
            else:
                continue
            for t in targets:
                while t and t not in mods:  # ``import a.b.c``: the deepest module there is
                    t = t.rpartition(".")[0]
                if t and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():  # the check below can fail
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_in_a_circle():
    found = cycles(import_graph(_modules()))
    assert not found, f"modules importing each other in a circle: {found}"


def _imports_from(graph, inside: str, forbidden: tuple[str, ...]) -> list[tuple[str, str]]:
    return sorted(
        (m, d)
        for m, deps in graph.items()
        if m == inside or m.startswith(inside + ".")
        for d in deps
        if any(d == f or d.startswith(f + ".") for f in forbidden) or d == "jaxsync"
    )


def test_the_core_never_imports_an_optional_area():
    bad = _imports_from(import_graph(_modules()), "jaxsync._core", OPTIONAL + ("jaxsync._cli",))
    assert not bad, f"the core imports an optional area (plug it in via _plugins): {bad}"


def test_the_inter_process_stage_never_imports_the_core():
    graph = import_graph(_modules())
    bad = _imports_from(graph, "jaxsync._comm", OPTIONAL + ("jaxsync._core", "jaxsync._cli"))
    assert not bad, f"jaxsync._comm imports from above it: {bad}"


def test_every_package_is_in_the_wheel():
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"(?ms)^packages = \[(.*?)\]", text).group(1)
    listed = set(re.findall(r'"([^"]+)"', block))
    packages = {m for m, p in _modules().items() if p.name == "__init__.py"}
    assert listed == packages, f"pyproject packages differ from the tree: {listed ^ packages}"


def test_the_areas_are_registered_by_import_jaxsync():
    import jaxsync  # noqa: F401 (imports the areas)
    from jaxsync._core import _plugins

    assert _plugins.strategy("auto") is not None
    assert set(_plugins._TREE_KINDS) == {"row_sparse"}
    assert set(_plugins._OPTIONS) == {"sparse"}


def test_importing_jaxsync_starts_no_jax_backend():
    """Nothing may run a JAX computation at import: a later
    ``jax.distributed.initialize()`` is then refused (the bench's jax.distributed
    peer failed so when a module built a float8 table with jnp at import)."""
    import subprocess
    import sys

    code = (
        "import jax._src.xla_bridge as xb\n"
        "import jaxsync, jaxsync.bench.cli, jaxsync.local, jaxsync.auto\n"
        "assert not xb._backends, 'a JAX backend was started at import'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]

"""A griffe extension for the docs' API page (mkdocs.yml loads it; static analysis only).

Three things the docstrings do that griffe's Google parser does not read as they are:

- ``Example:`` opens the doctests of every public function (the doctest runner does
  not care about the title); griffe renders code only under ``Examples:``, so the
  title is read as that.
- ``a, b, c: as for ...`` documents several arguments in one entry (its names may
  run onto more lines); griffe reads one name per entry, so the entry is given
  to each name.
- ``@takes(SomeKeywords)`` gives a factory its options as keywords at import time
  (``help()`` shows them); static analysis sees ``**overrides``, so the options
  the factory takes (the TypedDict's keys, in ``SyncOptions``' order) are named
  here in its docstring.
- ``name = _preset(mean, "strategy", doc)`` (``_core/_transforms``) makes a
  factory at import time; static analysis sees an attribute, so it is given here
  as the function it is: ``mean``'s parameters without ``strategy``, its return,
  and its docstring (``doc`` with the preset's Args and Returns: the one place
  this reads the imported module).
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

import griffe


def _walk(obj: griffe.Object):
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)  # type: ignore[arg-type]


class JaxsyncDocstrings(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any):
        _presets_as_functions(loader)
        for obj in _walk(pkg):
            doc = obj.docstring
            if doc is None:
                continue
            text = doc.value.replace("\nExample:\n", "\nExamples:\n")
            if text.startswith("Example:\n"):
                text = "Examples:\n" + text[len("Example:\n") :]
            if isinstance(obj, griffe.Function):
                text = _add_option_names(obj, text, loader)
            doc.value = _split_shared_args(text)


def _presets_as_functions(loader: griffe.GriffeLoader) -> None:
    module = loader.modules_collection["jaxsync._core._transforms"]
    for name, attr in list(module.members.items()):
        call = None if attr.is_alias else getattr(attr, "value", None)
        if not (isinstance(call, griffe.ExprCall) and str(call.function) == "_preset"):
            continue
        of, strategy, _ = call.arguments
        base = module.members[str(of)]
        doc = inspect.getdoc(getattr(importlib.import_module(module.path), name)) or ""
        fn = griffe.Function(
            name,
            lineno=attr.lineno,
            endlineno=attr.endlineno,
            parameters=griffe.Parameters(*[p for p in base.parameters if p.name != "strategy"]),
            returns=base.returns,
            docstring=griffe.Docstring(doc, lineno=attr.lineno, parser=base.docstring.parser),
        )
        # the options its strategy takes: _TAKES = {"naive": names_of(NaiveKeywords), ...}
        table = module.members["_TAKES"].value
        taken = dict(zip(map(str, table.keys), map(str, table.values)))[strategy]
        fn.extra["jaxsync"] = {"keywords": re.fullmatch(r"names_of\((\w+)\)", taken).group(1)}
        module.set_member(name, fn)


def _typed_dict_keys(cls: griffe.Class) -> list[str]:
    # the keys of a TypedDict of _options: its bases' first (same module), then its own
    keys: list[str] = []
    for base in cls.bases:
        parent = cls.parent.members.get(str(base)) if cls.parent else None
        if isinstance(parent, griffe.Class):
            keys += [k for k in _typed_dict_keys(parent) if k not in keys]
    keys += [n for n, m in cls.members.items() if m.is_attribute and n not in keys]
    return keys


def _add_option_names(fn: griffe.Function, text: str, loader: griffe.GriffeLoader) -> str:
    """``@takes(SomeKeywords)``: name the options the factory takes (``help()``
    shows them as its signature; static analysis sees ``**overrides`` only)."""
    given = [fn.extra["jaxsync"]["keywords"]] if "jaxsync" in fn.extra else []
    for dec in fn.decorators:
        m = re.fullmatch(r"(?:_options\.)?takes\((?:_options\.)?(\w+)\)", str(dec.value))
        if m:
            given.append(m.group(1))
    for keywords in given:
        cls = loader.modules_collection["jaxsync._core._options"].members[keywords]
        taken = set(_typed_dict_keys(cls))  # type: ignore[arg-type]
        keys = [k for k in _fields(loader) if k in taken]  # SyncOptions' order
        names = ", ".join(f"``{k}``" for k in keys)
        ends = [text.find(f"\n{title}:") for title in ("Returns", "Examples")]
        at = min([i for i in ends if i >= 0], default=len(text))
        note = f"\n\nOptions as keywords (each over ``options``): {names}.\n"
        return text[:at].rstrip("\n") + note + text[at:]
    return text


def _fields(loader: griffe.GriffeLoader) -> list[str]:
    opts = loader.modules_collection["jaxsync._core._options"].members["SyncOptions"]
    return [n for n, m in opts.members.items() if m.is_attribute]


_NAMES_CONT = re.compile(
    r"^(\s+)(\*{0,2}\w+(?:,\s*\*{0,2}\w+)*),\s*$"
)  # "  a, b," (more names below)
_NAMES = re.compile(r"^(\s+)(\*{0,2}\w+(?:,\s*\*{0,2}\w+)+):(.*)$")


def _split_shared_args(text: str) -> str:
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        # names running onto more lines: "  a, b," / "    c, d: description"
        while _NAMES_CONT.match(line) and i + 1 < len(lines):
            line = f"{line.rstrip()} {lines[i + 1].strip()}"
            i += 1
        m = _NAMES.match(line)
        if not m:
            out.append(line)
            i += 1
            continue
        indent, names, desc = m.groups()
        body = []
        i += 1
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > len(indent)):
            if not lines[i].strip():
                break
            body.append(lines[i])
            i += 1
        for name in (n.strip() for n in names.split(",")):
            out += [f"{indent}{name}:{desc}", *body]
    return "\n".join(out)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())

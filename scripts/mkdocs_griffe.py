"""A griffe extension for the docs' API page (mkdocs.yml loads it; static analysis only).

Two things the docstrings do that griffe's Google parser does not read as they are:

- ``Example:`` opens the doctests of every public function (the doctest runner does
  not care about the title); griffe renders code only under ``Examples:``, so the
  title is read as that.
- ``a, b, c: as for ...`` documents several arguments in one entry (its names may
  run onto a second line); griffe reads one name per entry, so the entry is given
  to each name.
- ``document_overlap`` adds the ``overlap``, ``overlap_bucket_bytes`` and
  ``double_buffering`` arguments to the MPI factories' docstrings at import time;
  without importing jaxsync, the same text (the decorator's module's ``_ARGS``) is
  added here, before ``Returns:``, as the decorator does.
"""

from __future__ import annotations

import ast
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
        for obj in _walk(pkg):
            doc = obj.docstring
            if doc is None:
                continue
            text = doc.value.replace("\nExample:\n", "\nExamples:\n")
            if text.startswith("Example:\n"):
                text = "Examples:\n" + text[len("Example:\n") :]
            if isinstance(obj, griffe.Function):
                for dec in obj.decorators:
                    if dec.callable_path.rsplit(".", 1)[-1] == "document_overlap":
                        text = _add_overlap_args(text, dec.callable_path, loader)
                        names = [p.name for p in obj.parameters]
                        if "weights" not in names:  # auto_mean: neither of the last two
                            text = re.sub(r"\n *weights: .*?(?=\nReturns:)", "", text, flags=re.S)
                        elif "early_termination" not in names:  # auto_mean with weights
                            text = re.sub(
                                r"\n *early_termination: .*?(?=\nReturns:)", "", text, flags=re.S
                            )
            doc.value = _split_shared_args(text)


def _add_overlap_args(text: str, path: str, loader: griffe.GriffeLoader) -> str:
    module = loader.modules_collection[path.rsplit(".", 1)[0]]
    args = ast.literal_eval(str(module.members["_ARGS"].value))
    # The docstring is dedented here: the decorator's text is indented for the
    # raw __doc__ (4 spaces of the function body), so take those off.
    args = "\n".join(line[4:] for line in args.rstrip("\n").splitlines())
    at = text.index("\nReturns:")
    text = text[:at] + "\n" + args + text[at:]
    return text.replace(
        "  ``check_finite``.\n",
        "  ``check_finite``; with ``double_buffering``,\n  :class:`jaxsync.DoubleBufferState`.\n",
        1,
    )


_NAMES_CONT = re.compile(r"^(\s+)(\w+(?:,\s*\w+)*),\s*$")  # "  a, b," (more names below)
_NAMES = re.compile(r"^(\s+)(\w+(?:,\s*\w+)+):(.*)$")  # "  a, b, c: description"


def _split_shared_args(text: str) -> str:
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        m = _NAMES_CONT.match(line)
        if m and i + 1 < len(lines) and ":" in lines[i + 1]:
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

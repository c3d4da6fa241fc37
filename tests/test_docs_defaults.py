"""What the docs say a factory's default is, against its signature (issue 46, item
12: docs/strategies.md said ``auto_mean`` keeps ``overlap=False``; its default is
``"auto"``)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import jaxsync

DOCS = Path(__file__).resolve().parent.parent / "docs"


PATTERNS = (
    r"`(\w+_mean)` keeps `overlap=(\w+)`",
    r"`(\w+_mean)` follows the same rule \(its `overlap` defaults to `\"(\w+)\"`",
)


def test_the_overlap_defaults_the_docs_state_are_the_signatures():
    said = []
    for page in sorted(DOCS.glob("*.md")):
        text = " ".join(page.read_text().split())
        for pattern in PATTERNS:
            said += [(page.name, name, value) for name, value in re.findall(pattern, text)]
    assert said, "the pages no longer say what auto_mean's overlap default is"
    for page, name, value in said:
        default = inspect.signature(getattr(jaxsync, name)).parameters["overlap"].default
        assert str(default) == value, f"{page}: {name}'s overlap default {default!r}, not {value}"

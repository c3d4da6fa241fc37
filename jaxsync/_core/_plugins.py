"""Where the optional areas plug into the core.

The core (config, sync, transforms) never imports ``jaxsync.sparse`` or
``jaxsync.auto``: each registers here when it is imported (``import jaxsync``
imports both), and the core asks here at the three places it meets them: a tree
with leaves of a registered kind (``RowSparse``: the tree is split there), a
strategy it does not implement itself (``"auto"``: a transform made there, the
choice resolved at trace time), and an option only an area reads (``sparse=``);
``jaxsync.local`` checks every synchronisation traced inside its inner chain
(``check_sync``: an inner mean must not span islands).

Imports: the standard library only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple


class TreeKind(NamedTuple):
    """Leaves the dense path does not take: ``has(tree)`` says whether ``tree``
    holds any, ``sync(tree, cfg, dense_sync)`` reduces it (the dense leaves with
    ``dense_sync``)."""

    name: str
    has: Callable[[Any], bool]
    sync: Callable[..., Any]


class Strategy(NamedTuple):
    """A strategy chosen at trace time: ``make_config(fn, axis_name, comm,
    **options)`` when the factory is called, ``resolve(tree, cfg)`` when traced."""

    make_config: Callable[..., Any]
    resolve: Callable[[Any, Any], Any]


_TREE_KINDS: dict[str, TreeKind] = {}
_STRATEGIES: dict[str, Strategy] = {}
_OPTIONS: dict[str, Callable[[str, Any], Any]] = {}
_SYNC_CHECKS: list[Callable[[Any], None]] = []


def register_tree_kind(kind: TreeKind) -> None:
    _TREE_KINDS[kind.name] = kind


def register_strategy(name: str, strategy: Strategy) -> None:
    _STRATEGIES[name] = strategy


def register_option(name: str, check: Callable[[str, Any], Any]) -> None:
    """``check(fn, value)`` validates option ``name`` of factory ``fn``."""
    _OPTIONS[name] = check


def register_sync_check(check: Callable[[Any], None]) -> None:
    """``check(cfg)`` runs when a synchronisation is traced (jaxsync.local's island guard)."""
    _SYNC_CHECKS.append(check)


def check_sync(cfg) -> None:
    for check in _SYNC_CHECKS:
        check(cfg)


def tree_kind(tree) -> TreeKind | None:
    """The registered kind of leaves ``tree`` holds, if any."""
    for kind in _TREE_KINDS.values():
        if kind.has(tree):
            return kind
    return None


def strategy(name: str) -> Strategy | None:
    return _STRATEGIES.get(name)


def check_option(name: str, fn: str, value):
    """The validated ``value`` of option ``name`` (``None`` if no area reads it)."""
    check = _OPTIONS.get(name)
    if check is not None:
        return check(fn, value)
    if value is not None:  # pragma: no cover - every area is imported by jaxsync
        raise ValueError(f"{fn}: option {name}={value!r} needs its area imported (import jaxsync).")
    return None

"""``strategy="auto"``'s choice: the fastest candidate by the cost model.

What it is for: :func:`choose` prices every candidate (strategy x
``bucket_bytes`` x ``pack_threshold``) for a tree and a topology with
``jaxsync.auto._cost_ops.predict`` and returns a :class:`Choice` (what was chosen, the
predictions of all candidates, notes on the profile), deterministically.
``jaxsync.auto._auto`` calls it at trace time and re-exports it.

May import: the standard library, ``jaxsync.auto._cost``, ``_cost_ops``, ``_host``
(the allocator's state, for a note) and (inside functions) ``jaxsync._core._plan``.
"""

from __future__ import annotations

import dataclasses
from typing import Final

from jaxsync._comm._host import host_allocator_state

from . import _cost, _cost_ops
from ._cost import Profile
from ._cost_ops import BucketInfo, ModelTopology

AUTO: Final = "auto"
CANDIDATE_STRATEGIES = ("hierarchical", "two_dimensional", "flat", "naive")
"""In order of preference on a tie (within a relative 1e-9)."""
CANDIDATE_BUCKETS = (16 * 2**20, 64 * 2**20)
CANDIDATE_THRESHOLDS = (None, 64 * 2**10, 256 * 2**10, 1 * 2**20, 4 * 2**20)
LOSSY_WIRE = {"bfloat16": 2, "float16": 2}
"""Lossy wire dtypes ``auto`` may choose when allowed, and their bytes per element."""


LOSSY_TRANSFORMS = ("powersgd", "sign")
"""Lossy kinds ``auto`` does not choose: they are transforms with state of their own."""


def check_allow_lossy(fn: str, allow_lossy, comm_dtype=None) -> tuple:
    """``allow_lossy`` validated: the lossy wire dtypes ``auto`` may choose.

    ``False`` (default): none; ``True``: ``("bfloat16",)``; a tuple of names from
    :data:`jaxsync.auto._choose.LOSSY_WIRE` (``"bfloat16"``, ``"float16"``).
    ``"powersgd"`` and ``"sign"`` are refused: ``auto`` chooses when the step
    is traced, after ``init`` has made the state, and those transforms carry
    state of their own (error feedback, factors); choosing them would make the
    optimizer state's kind depend on the profile (checkpoints, ``state_specs``).

    Example:
      >>> check_allow_lossy("auto_mean", True)
      ('bfloat16',)
      >>> check_allow_lossy("auto_mean", ["float16", "bfloat16"])
      ('bfloat16', 'float16')
      >>> check_allow_lossy("auto_mean", False)
      ()
    """
    kinds = tuple(LOSSY_WIRE)
    if isinstance(allow_lossy, bool):
        got = ("bfloat16",) if allow_lossy else ()
    elif isinstance(allow_lossy, (tuple, list)) and all(isinstance(k, str) for k in allow_lossy):
        bad = [k for k in allow_lossy if k not in kinds]
        if any(k in LOSSY_TRANSFORMS for k in bad):
            raise ValueError(
                f"{fn}: allow_lossy may name the wire dtypes {kinds}, got {tuple(allow_lossy)!r}; "
                f"{'/'.join(k for k in bad if k in LOSSY_TRANSFORMS)} cannot be chosen at "
                "trace time (their state, made by init, is of another kind; it would "
                "then depend on the profile). Fix: allow_lossy=('bfloat16',), or use "
                "jaxsync.powersgd_mean / jaxsync.sign_mean directly."
            )
        if bad:
            raise ValueError(
                f"{fn}: allow_lossy must name wire dtypes from {kinds}, got {bad!r}. "
                "Fix: allow_lossy=('bfloat16',) or allow_lossy=True."
            )
        got = tuple(sorted(set(allow_lossy), key=kinds.index))
    else:
        raise TypeError(
            f"{fn} got unexpected type for argument 'allow_lossy' (expected: a bool or a "
            f"tuple of names from {kinds}, got: {type(allow_lossy).__name__} "
            f"{allow_lossy!r}). Fix: allow_lossy=True (bfloat16 on the wire when faster) "
            "or allow_lossy=('bfloat16',)."
        )
    if got and comm_dtype is not None:
        raise ValueError(
            f"{fn}: allow_lossy={allow_lossy!r} lets auto choose the wire dtype, but "
            f"comm_dtype={comm_dtype!r} fixes it. Fix: pass one of them (drop comm_dtype "
            "to let auto choose, or allow_lossy=False to keep yours)."
        )
    return got


@dataclasses.dataclass(frozen=True)
class Choice:
    """The outcome: what was chosen and the predicted seconds of every candidate."""

    strategy: str
    bucket_bytes: int | None
    pack_threshold: int | None
    seconds: float
    table: tuple  # ((strategy, bucket_bytes, pack_threshold, seconds, comm_dtype), ...)
    topology: ModelTopology
    profile_note: str
    warnings: tuple = ()
    comm_dtype: str | None = None  # a lossy wire dtype chosen (allowed by the user)
    allow_lossy: tuple = ()  # the lossy wire dtypes the user allowed

    def describe(self) -> str:
        t = self.topology
        wire = f", comm_dtype {self.comm_dtype} (lossy)" if self.comm_dtype else ""
        allowed = ", ".join(self.allow_lossy) if self.allow_lossy else "none"
        lines = [
            f"jaxsync auto: {self.strategy} (bucket_bytes {_fmt(self.bucket_bytes)}, "
            f"pack_threshold {_fmt(self.pack_threshold)}{wire}), predicted "
            f"{self.seconds * 1e3:.3f} ms; {t.processes} process(es) on {t.hosts} "
            f"host(s) x {t.local_devices} device(s), inter link "
            f"{t.link if t.processes > 1 else '-'}; lossy allowed: {allowed}; "
            f"{self.profile_note}"
        ]
        lines += [f"  note: {w}" for w in self.warnings]
        best: dict = {}
        for s, b, th, sec, dt in self.table:
            if (s, dt) not in best or sec < best[s, dt][2]:
                best[s, dt] = (b, th, sec)
        for (s, dt), (b, th, sec) in best.items():
            mark = "*" if (s, dt) == (self.strategy, self.comm_dtype) else " "
            name = f"{s} {dt}" if dt else s
            lines.append(
                f" {mark} {name:<16} {sec * 1e3:9.3f} ms  (bucket_bytes {_fmt(b)}, "
                f"pack_threshold {_fmt(th)})"
            )
        return "\n".join(lines)


def _fmt(n):
    if n is None:
        return "none"
    return (
        f"{n // 2**20} MiB"
        if n >= 2**20 and n % 2**20 == 0
        else (f"{n // 2**10} KiB" if n % 2**10 == 0 else f"{n} B")
    )


def buckets_of(plan) -> list[BucketInfo]:
    return [BucketInfo(b.dtype, b.nbytes, len(b.leaves)) for b in plan.buckets]


def _check_profile_topology(profile: Profile, topo: ModelTopology) -> tuple:
    notes = []
    need = ["device"] if topo.local_devices > 1 else []
    if topo.processes > 1:
        need.append(topo.link)
    for name in need:
        if not profile.has(name):
            notes.append(
                f"the profile has no '{name}' link (not measured on its "
                f"machine): built-in default used for it"
            )
    got = profile.topology
    if got:
        here = {
            "processes": topo.processes,
            "hosts": topo.hosts,
            "local_devices": topo.local_devices,
        }
        if any(got.get(k) != v for k, v in here.items()):
            notes.append(
                f"the profile was measured on {got.get('processes')} process(es) "
                f"x {got.get('local_devices')} device(s), {got.get('hosts')} host(s); "
                f"this is {topo.processes} x {topo.local_devices}, {topo.hosts}: its "
                "link parameters are used as they are"
            )
        notes += _check_allocator(got.get("host_allocator"))
    return tuple(notes)


def _check_allocator(measured: str | None) -> list[str]:
    """A note when the profile's host allocator is not this process's."""
    here = host_allocator_state()
    if measured is None or measured == here:
        return []
    how = {
        "tuned": "with jaxsync.tune_host_allocator()",
        "default": "with glibc's default allocator",
    }
    return [
        f"the profile was measured {how.get(measured, measured)} and this process runs "
        f"{how.get(here, here)}: large fresh buffers cost page faults in one and not "
        "the other. Fix: call jaxsync.tune_host_allocator() early in both, or neither "
        "(python -m jaxsync tune --tune-host-allocator records the first)"
    ]


def choose(
    tree,
    topo: ModelTopology,
    profile: Profile | None = None,
    *,
    bucket_bytes=AUTO,
    pack_threshold=AUTO,
    comm_itemsize: int | None = None,
    strategies=CANDIDATE_STRATEGIES,
    profile_note: str = "",
    lossy: tuple = (),
) -> Choice:
    """The fastest (strategy, bucket_bytes, pack_threshold) for ``tree`` by the model.

    ``tree`` is a pytree of arrays or ``jax.ShapeDtypeStruct``. Deterministic:
    candidates are tried in a fixed order and the first within a relative
    1e-9 of the fastest wins. ``lossy``: wire dtypes (:data:`LOSSY_WIRE`) the
    user allows (``auto_mean(allow_lossy=...)``): every candidate is priced
    with each of them too, after all lossless ones, so that a lossy candidate
    is chosen only when predicted faster than every lossless one.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxsync.auto import _auto, _cost_ops
      >>> tree = {f"w{i}": jax.ShapeDtypeStruct((256,), jnp.float32) for i in range(200)}
      >>> topo = _cost_ops.ModelTopology(processes=2, hosts=1, local_devices=4)
      >>> c = _auto.choose(tree, topo)
      >>> c.strategy != "naive"   # 200 messages would cost 200 latencies
      True
      >>> c == _auto.choose(tree, topo)
      True
    """
    from jaxsync._core._plan import make_plan

    profile = profile or _cost.DEFAULT_PROFILE
    buckets_opts = CANDIDATE_BUCKETS if bucket_bytes == AUTO else (bucket_bytes,)
    thr_opts = CANDIDATE_THRESHOLDS if pack_threshold == AUTO else (pack_threshold,)
    table, seen = [], {}
    wires = [(None, comm_itemsize)] + [(d, LOSSY_WIRE[d]) for d in lossy]
    leaves = buckets_of(make_plan(tree, per_leaf=True))
    for dtype, itemsize in wires:
        # the host tier's "auto": most of the bytes 16-bit on this wire
        wire = [(itemsize or b.itemsize, b.nbytes // b.itemsize) for b in leaves]
        wire16 = 2 * sum(2 * n for isz, n in wire if isz == 2) > sum(i * n for i, n in wire)
        for s in strategies:
            per_leaf = _cost_ops.per_leaf_plan(s, topo, wire16)
            for b in buckets_opts:
                for t in thr_opts:
                    plan = make_plan(tree, bucket_bytes=b, pack_threshold=t, per_leaf=per_leaf)
                    key = (s, plan.buckets, dtype)
                    if key in seen:  # the same program as an earlier candidate
                        continue
                    seen[key] = True
                    sec = _cost_ops.predict(
                        s, buckets_of(plan), topo, profile, itemsize, bucket_bytes=b
                    )
                    table.append((s, b, t, float(sec), dtype))
    if not table:
        raise ValueError("jaxsync auto: no candidate strategy")
    best = min(row[3] for row in table)
    pick = next(row for row in table if row[3] <= best * (1 + 1e-9))
    return Choice(
        pick[0],
        pick[1],
        pick[2],
        pick[3],
        tuple(table),
        topo,
        profile_note,
        _check_profile_topology(profile, topo),
        comm_dtype=pick[4],
        allow_lossy=tuple(lossy),
    )

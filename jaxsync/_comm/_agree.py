"""Cross-process agreement: the header every synchronisation checks when it runs.

Before their reductions the processes compare what they are about to do
(tree structure, shapes, dtypes, options): a mismatch would otherwise issue
different collectives on each process (a hang or wrong sums). Doing that
exchange while *tracing* blocks whenever one process traces alone - a common
``jax.eval_shape``, ``.lower()`` or ``jax.make_jaxpr`` on rank 0 - so it runs
inside the compiled step instead. On CPU jaxsync's native call checks a header
on every run: the plan's digest and the steps since the synchronisation last
ran (``_native/agree.cc``; ``reach_site`` below finds where the step is
counted). Elsewhere a host callback (``pure_callback``, so the step has no
effect and keeps jit's fast dispatch) whose (zero) result is folded into the
buffers before any MPI call can read them exchanges a 32-byte digest the first
time each compiled executable runs (full texts only on a mismatch) and is a
no-op afterwards.

Every device of a process calls the callback; the first one exchanges, the
others wait for its answer. Several agreements in one trace are chained, so
every process runs them in the same order. A mismatch raises the same
``ValueError`` text on every process, from inside the step (JAX reports it as a
``JaxRuntimeError`` whose message holds the ``ValueError``).

It uses a communicator of its own (``Comms.agreement``) and plain mpi4py, so it
is independent of how the MPI calls of the step itself are bound. On CPU the
native calls check the same texts themselves (``_mpi_load.register_agreement``);
both, and ``broadcast_params``, report a mismatch with ``_disagreement`` (below),
which names the option that differs where the options do.

Imports: jax, ``_ordering`` and ``_invariance`` only.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core as _core
from jax.experimental import io_callback

from . import _ordering
from ._invariance import _varying, _vma

# One exchange at a time on a process (device threads, several executables).
_LOCK = threading.Lock()

# Agreement callbacks entered and left (every synchronised step runs one per
# device): the drain at exit watches them (see _quiet.wait_until_quiet).
ACTIVITY = [0, 0]


class Agreement:
    """One trace's check: exchanges once, remembers the verdict."""

    def __init__(self, comm, text: str, what: str, disagreement):
        self.comm = comm
        self.text = text
        self.what = what
        self.disagreement = disagreement  # texts -> error message
        self.digest = hashlib.sha256(text.encode()).digest()
        self.verdict: str | None = None  # None: not yet; "" agreed; else the error
        self.exchanges = 0

    def check(self) -> None:
        if self.verdict is None:
            with _LOCK:
                if self.verdict is None:
                    self.exchanges += 1
                    digests = self.comm.allgather(self.digest)
                    if len(set(digests)) > 1:
                        self.verdict = self.disagreement(self.comm.allgather(self.text), self.what)
                    else:
                        self.verdict = ""
        if self.verdict:
            raise ValueError(self.verdict)

    def host(self, *deps):
        del deps
        ACTIVITY[0] += 1
        try:
            self.check()
        finally:
            ACTIVITY[1] += 1
        return np.zeros((), np.uint8)


def agreement_dep(comm, text: str, what: str, disagreement, after=None):
    """A uint8 zero computed by the in-step agreement on ``text`` over ``comm``.

    Whatever depends on it runs after the check; the check runs after ``after``
    (a value, or None). Several agreements of one traced step form one chain
    (kept per trace, like the MPI token chain), so every process runs them in
    the same order.
    """
    agreement = Agreement(comm, text, what, disagreement)
    prev = _ordering.chain_value("agreement", lambda: None)
    deps = tuple(d for d in (prev, after) if d is not None)
    # A pure_callback, not an io_callback: any effect in a step puts jit's
    # dispatch on its slow path (tens of microseconds per output: +12 ms on a
    # step returning 500 leaves). Its result feeds the MPI calls, so JAX cannot
    # drop it, and running it again is harmless: only the first call of each
    # compiled step exchanges anything, later ones read the verdict.
    dep = jax.pure_callback(
        agreement.host,
        jax.ShapeDtypeStruct((), jnp.uint8),
        *deps,
        vmap_method="broadcast_all",
    )
    _ordering.set_chain_value("agreement", dep)
    return dep


def tie_buffers(bufs: list, dep) -> list:
    """``bufs`` unchanged bit for bit, but read by MPI only after ``dep``.

    Every MPI call of the step reads, directly or through the token chain that
    orders them, the first buffer of some dtype: tying those is enough (one tiny
    update per dtype, not per buffer). jaxsync's native calls take the dependency
    through their ``active`` operand instead, which copies nothing.
    """
    out, tied = [], set()
    for b in bufs:
        if str(b.dtype) not in tied and _foldable(b):
            tied.add(str(b.dtype))
            b = fold(b, dep)
        out.append(b)
    return out


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _foldable(x) -> bool:
    return x.size > 0 and x.ndim == 1 and x.dtype.itemsize in _UINT


def fold(x, dep):
    """``x`` unchanged bit for bit, but computed after ``dep`` (a uint8 zero)."""
    if not _foldable(x):
        return x
    width = _UINT[x.dtype.itemsize]
    head = lax.bitcast_convert_type(lax.slice(x, (0,), (1,)), width)
    d = _varying(lax.convert_element_type(dep, width), _vma(head))
    head = lax.bitcast_convert_type(head ^ d, x.dtype)
    return lax.dynamic_update_slice(x, head, (0,))


def reach_site(ident: int) -> tuple:
    """``(site, top)``: the how-manieth synchronisation of plan ``ident`` this is
    in its traced step, and the trace at the top of the step where it sits in
    the body of a ``lax.cond`` or loop (else ``None``): the step is counted
    there, on every run, whichever branch then runs."""
    trace = _ordering._owner()
    if isinstance(trace, _core.EvalTrace):
        return 0, None  # eagerly: each call its own program
    top = trace
    while (parent := _ordering._enclosing(top)) is not None:
        top = parent
    key = f"agree-site-{ident}"
    # The top trace's table, not pruned (the body's trace is not its ancestor).
    entry = _ordering._table(top, prune=False).setdefault(top, {})
    site = entry.get(key, 0)
    entry[key] = site + 1
    return site, (None if top is trace else top)


def keep_alive(dep) -> None:
    """Keep the check that computes ``dep`` in the step though nothing reads
    it (a synchronisation with nothing to travel): an unordered host callback
    reads it."""
    io_callback(lambda d: None, None, dep, ordered=False)


_FIXES = {
    "gradient tree": "make every process build the same gradient tree (same structure, "
    "shapes and dtypes), drive the same number of devices, and create "
    "the transform with the same options",
    "parameter tree": "call broadcast_params on every process with the same root and a "
    "tree of the same structure, shapes and dtypes (only the values may differ)",
    "broadcast root": "pass the same root to broadcast_params on every process",
    "configuration": "create the local-update transform with the same options (every, "
    "fragments, delay, mix, the outer optimizer) and parameter tree on every process",
}

# The options line of an agreed text (``SyncConfig.describe``): "key value"
# pairs, and flags without a value.
_OPTION_KEYS = (
    "strategy", "reduce", "comm_dtype", "predivide", "check_finite", "backend",
    "staging", "timeout", "on_timeout", "overlap", "host_tier", "weights",
    "early_termination", "accumulate",
)  # fmt: skip
_FLAGS = ("double_buffering",)


def _options(text: str) -> dict | None:
    """The transform's options in an agreed text (``None``: it has none)."""
    lines = text.splitlines()
    line = next((x for x in lines if x.startswith("strategy ")), None)
    if line is None:
        return None
    words, out = line.split(), {}
    for i, w in enumerate(words):
        if w in _OPTION_KEYS and i + 1 < len(words):
            out[w] = words[i + 1]
        elif w in _FLAGS:
            out[w] = "True"
        elif w == "profile" and i + 1 < len(words):
            out["auto profile"] = words[i + 1]
    if "sharded" in lines:  # jaxsync.sharded's text (its reduce-scatter is two_dimensional's)
        out["strategy"] = "sharded"
    return out


def _option_difference(a: str, b: str) -> list[tuple[str, str]]:
    """``"strategy flat" / "strategy hierarchical"`` pairs of the options that differ."""
    oa, ob = _options(a), _options(b)
    if oa is None or ob is None:
        return []
    keys = [k for k in (*_OPTION_KEYS, *_FLAGS, "auto profile") if oa.get(k) != ob.get(k)]
    return [(f"{k} {oa.get(k, '<unset>')}", f"{k} {ob.get(k, '<unset>')}") for k in keys]


def _disagreement(texts: Sequence[str], what: str) -> str:
    """Name the first two ranks that differ and what differs: the transform's
    options where they do (the plan's lines follow from them), else the first
    differing line."""
    base = texts[0]
    other = next(r for r, t in enumerate(texts) if t != base)
    w = len(f"rank {other}:")
    options = _option_difference(base, texts[other])
    if options:
        oa = ", ".join(x for x, _ in options)
        ob = ", ".join(y for _, y in options)
        return (
            f"jaxsync: the transform's options differ between rank 0 and rank {other} "
            f"({', '.join(x.split(' ')[0] for x, _ in options)}), so the processes would "
            f"issue different collectives (a hang or wrong results).\n"
            f"  {'rank 0:':<{w}} {oa}\n  {f'rank {other}:':<{w}} {ob}\n"
            "Fix: create the transform with the same options on every process."
        )
    a, b = base.splitlines(), texts[other].splitlines()
    for la, lb in zip(a + [""] * (len(b) - len(a)), b + [""] * (len(a) - len(b))):
        if la != lb:
            break
    if la.startswith("root ") and lb.startswith("root "):
        what = "broadcast root"  # broadcast_params' root, first in its text
    fix = _FIXES.get(what, "make every process agree")
    keys = ""
    if what.endswith(" configuration"):  # jaxsync.local's: "key value" pairs
        fix = _FIXES["configuration"]
        named = _keys_that_differ(la, lb)
        keys = f" ({', '.join(named)})" if named else ""
    return (
        f"jaxsync: the {what} differs between rank 0 and rank {other}{keys}, so the "
        f"processes would issue different collectives (a hang or wrong results).\n"
        f"  {'rank 0:':<{w}} {la or '<nothing>'}\n  {f'rank {other}:':<{w}} "
        f"{lb or '<nothing>'}\nFix: {fix}."
    )


def _keys_that_differ(a: str, b: str) -> list[str]:
    """In two lines of ``key value`` words, the keys whose values differ."""
    wa, wb = a.split(), b.split()
    if len(wa) != len(wb):
        return []
    return [
        wa[i - 1]
        for i in range(1, len(wa))
        if wa[i] != wb[i] and wa[i - 1] == wb[i - 1] and wa[i - 1].isidentifier()
    ]

"""Cross-synchronisation ordering: one chain of inter-process calls per traced step.

Each inter-process call consumes the token of the previous call in the same
traced computation, so two synchronisations in one step (or the buckets of
one) run in the same order on every process. The latest token of each trace
is kept per thread in a WeakKeyDictionary keyed by the trace; entries of
traces that are no longer on the current trace's ancestor chain (finished
traces: tracing is a stack within a thread) are dropped on each access, so
at most the last traced step's chain stays referenced until the next trace.

Besides the MPI token (``chain_token``), named chains carry other values the
same way (``chain_value``: the host-staging dependency byte, the agreement
callbacks, the ``lax.cond`` tie), and ``_after`` ties two values by data where
no token can pass (out of a ``lax.cond``).

Control flow. A synchronisation inside the body of ``lax.cond``, ``lax.switch``,
``lax.scan``, ``lax.while_loop`` or ``lax.fori_loop`` (``optax.MultiSteps`` runs
its inner update inside ``lax.cond``) is traced in a trace of its own, which
would start a chain of its own: nothing would order its calls with those of the
step around it, and ranks whose compiled programs differ (rank-dependent code)
could issue them in different orders and wait for each other for ever. So the
chain is threaded through: a body's first call continues the enclosing trace's
chain (on the native path its token becomes a one-element buffer, which the
body closes over, so it enters the control-flow operation as an operand), and
the enclosing trace's next call waits for the control-flow operation itself (a
no-op native call on one element of its outputs: every output of an XLA
conditional or loop exists only once the whole operation has run). The token
crosses as data because a token cannot cross ``lax.cond`` under ``shard_map``.
mpi4jax's calls (GPUs) have no call that turns a token into data, so their
chain crosses by the data the calls return (``chain_after``): a body's first
call waits, through ``_tie.tie``, for the last result of the enclosing trace's
chain (the value enters the control-flow operation as an operand), and the
enclosing trace's next call waits for the control-flow operation's outputs, as
on the native path. No host callback, no copy. The host-staging chains inside
control flow keep a chain of their own (see docs/sharp-bits.md).

Imports: jax and ``_invariance`` only (``_native_prim`` registers the native call).
"""

from __future__ import annotations

import math
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core as _core
from jax._src import source_info_util
from jax._src.interpreters import batching
from jax._src.interpreters import partial_eval as _pe

from ._invariance import _varying, _vma

_chains = threading.local()


def _strip(trace):
    """``trace`` past any vmap traces (they pass values up to their parent)."""
    while isinstance(trace, batching.BatchTrace):
        trace = trace.parent_trace
    return trace


def _owner():
    """The trace that owns tokens made here (vmap's traces pass values up)."""
    return _strip(_core.trace_ctx.trace)


def _ancestors(trace):
    seen = []
    while trace is not None:
        seen.append(trace)
        trace = getattr(trace, "parent_trace", None)
    return seen


def _table(trace, prune: bool = True) -> weakref.WeakKeyDictionary:
    table = getattr(_chains, "table", None)
    if table is None:
        table = _chains.table = weakref.WeakKeyDictionary()
    if prune:
        live = _ancestors(trace)
        for t in list(table.keys()):
            if not any(t is a for a in live):
                del table[t]
    return table


# The traces of control-flow bodies (DebugInfo.traced_for), whose calls join
# the chain of the trace they are nested in.
_BODIES = frozenset(("cond", "switch", "scan", "while_body", "while_cond", "fori_loop"))
# The primitives that issue inter-process calls in a chain.
_CALLS = frozenset(("jaxsync_native", "jaxsync_mpi"))
_PENDING = "__pending_bodies"  # an entry's key: tracing_eqns index of the first body call
# mpi4jax's chain: what the trace's next call waits for (outputs of control flow
# whose bodies made calls), the last call's result (one element) and whether
# the trace's first call took the enclosing chain's.
_AFTER, _HEAD, _JOINED = "__after", "__head", "__joined"


def _enclosing(trace):
    """The trace a control-flow body's ``trace`` is nested in, else ``None``."""
    if not isinstance(trace, _pe.DynamicJaxprTrace):
        return None
    if getattr(trace.frame.debug_info, "traced_for", None) not in _BODIES:
        return None
    parent = _strip(trace.parent_trace)
    return parent if isinstance(parent, _pe.DynamicJaxprTrace) else None


# The native target's call and whether it is loaded, registered by
# ``_native_prim`` when it is imported (it is before any native call is traced).
_bridge: dict = {}


def register_native(call, loaded) -> None:
    """``call``: ``_native_prim.native_call``; ``loaded()``: the target is loaded."""
    _bridge["call"], _bridge["loaded"] = call, loaded


def _native() -> bool:
    return "loaded" in _bridge and bool(_bridge["loaded"]())


def _to_data(token):
    """(token, one-element float32 buffer that exists once ``token`` does): a
    native call with ``active=0`` (returns at once, no MPI)."""
    token, (dep,) = _bridge["call"](
        "allreduce", [jnp.zeros((1,), jnp.float32)], token, jnp.int32(0), jnp.int32(0), 1
    )
    return token, dep


def _from_data(token, dep):
    """``token``, after ``dep`` exists (a native call with ``active=0`` reads it)."""
    token, _ = _bridge["call"]("allreduce", [dep], token, jnp.int32(0), jnp.int32(0), 1)
    return token


def _calls_inside(jaxprs) -> bool:
    for jaxpr in jaxprs:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in _CALLS or _calls_inside(_core.jaxprs_in_params(eqn.params)):
                return True
    return False


def _tainted(eqn) -> set[int]:
    """The outputs of a recorded operation that depend on a call made inside it.

    Only those order what comes after: XLA simplifies control flow (a loop of
    one trip is unrolled, a branch on a constant inlined) and an output that
    does not depend on the calls (a loop counter) may then be computed before
    them. Every sub-jaxpr with as many outputs as ``eqn`` (a cond's branches, a
    loop's body, a scan's body, a call's jaxpr) is followed through.
    """
    out: set[int] = set()
    for jaxpr in _core.jaxprs_in_params(eqn.params):
        if len(jaxpr.outvars) != len(eqn.outvars):
            continue
        marked: set = set()
        for e in jaxpr.eqns:
            if e.primitive.name in _CALLS:
                marked.update(e.outvars)
            elif any(isinstance(v, _core.Var) and v in marked for v in e.invars):
                marked.update(e.outvars)
            else:
                inner = _tainted(e)
                marked.update(v for k, v in enumerate(e.outvars) if k in inner)
        out.update(
            k for k, v in enumerate(jaxpr.outvars) if isinstance(v, _core.Var) and v in marked
        )
    return out


def _join_bodies(trace, entry) -> None:
    """The chain of ``trace`` waits for each control-flow operation recorded in it
    since one of its bodies made a call (their outputs exist once they ran)."""
    mark = entry.pop(_PENDING, None)
    if mark is None:
        return
    deps = []
    for ref in trace.frame.tracing_eqns[mark:]:
        eqn = ref() if isinstance(ref, weakref.ReferenceType) else ref
        if eqn is None or not _calls_inside(_core.jaxprs_in_params(eqn.params)):
            continue
        tainted = _tainted(eqn)
        for k, var in enumerate(eqn.outvars):
            shape = getattr(var.aval, "shape", None)
            if k in tainted and shape is not None and math.prod(shape) > 0:
                deps.append(trace.var_to_tracer(var, source_info_util.current(), eqn))
                break
    if not deps:
        return
    if not _native():  # mpi4jax's chain: the next call's input waits for them
        entry.setdefault(_AFTER, []).extend(deps)
        return
    with _core.set_current_trace(trace):
        token = entry.get("token")
        token = lax.create_token() if token is None else token
        for out in deps:
            token = _from_data(token, out.reshape(-1)[:1].astype(jnp.float32))
    entry["token"] = token


def _entry(trace, prune: bool = True) -> dict:
    entry = _table(trace, prune).setdefault(trace, {})
    if _PENDING in entry:
        _join_bodies(trace, entry)
    return entry


def _inherited_token(trace):
    """A control-flow body's first token: the enclosing trace's chain, crossed
    as data (``None`` where no enclosing trace has a chain yet)."""
    parent = _enclosing(trace)
    if parent is None or not _native():
        return None
    with _core.set_current_trace(parent):
        outer = _token_of(parent)
        if outer is None:
            return None
        outer, dep = _to_data(outer)
        _entry(parent, prune=False)["token"] = outer
    return _from_data(lax.create_token(), dep)


def _token_of(trace):
    entry = _entry(trace, prune=False)
    token = entry.get("token")
    if token is None:
        token = _inherited_token(trace)
        if token is not None:
            entry["token"] = token
    return token


def _inherited_after(trace) -> list:
    """What a control-flow body's first mpi4jax call waits for: the enclosing
    traces' last results and the control flow pending in them (values of those
    traces, closed over by the body)."""
    parent = _enclosing(trace)
    if parent is None:
        return []
    entry = _entry(parent, prune=False)
    got = list(entry.get(_AFTER, ())) + ([entry[_HEAD]] if _HEAD in entry else [])
    if _HEAD not in entry and _JOINED not in entry:
        got += _inherited_after(parent)  # no call of its own yet: its parent's
    return got


def chain_after() -> list:
    """The values the next mpi4jax call's input must wait for (``_tie.tie``), taken
    once: control flow of this trace whose bodies made calls and, for a body's
    first call, the enclosing chain's last results. Empty eagerly and on the
    native path (its tokens cross as data, ``_to_data``)."""
    trace = _owner()
    if isinstance(trace, _core.EvalTrace) or _native():
        return []
    _table(trace)
    entry = _entry(trace, prune=False)
    after = entry.pop(_AFTER, [])
    if _JOINED not in entry:
        entry[_JOINED] = True
        after = after + _inherited_after(trace)
    return after


def set_chain_head(y) -> None:
    """Record an mpi4jax call's result ``y``: a body's first call after it waits for it."""
    trace = _owner()
    if isinstance(trace, _core.EvalTrace) or y.size == 0:
        return
    _table(trace).setdefault(trace, {})[_HEAD] = y.reshape(-1)[:1]


def chain_value(key: str, first):
    """The latest value of chain ``key`` in the current traced computation.

    ``first()`` makes the value the chain starts from. Eagerly (no trace) the
    chain is one concrete value per thread (a token or a byte, nothing traced).
    """
    trace = _owner()
    if isinstance(trace, _core.EvalTrace):
        value = getattr(_chains, "eager", {}).get(key)
        return first() if value is None else value
    _table(trace)  # drops finished traces' entries
    value = _token_of(trace) if key == "token" else _entry(trace, prune=False).get(key)
    return first() if value is None else value


def set_chain_value(key: str, value) -> None:
    """Record ``value`` as the latest of chain ``key`` in the current trace."""
    trace = _owner()
    if isinstance(trace, _core.EvalTrace):
        if not hasattr(_chains, "eager"):
            _chains.eager = {}
        _chains.eager[key] = value
        return
    table = _table(trace)
    table.setdefault(trace, {})[key] = value
    if key != "token":
        return
    # A body's call: each enclosing trace's next call waits for the operation.
    parent = _enclosing(trace)
    while parent is not None:
        pending = table.setdefault(parent, {})
        if _PENDING not in pending:
            pending[_PENDING] = len(parent.frame.tracing_eqns)
        parent = _enclosing(parent)


def chain_token():
    """The latest MPI token of the current traced computation (a new one at first)."""
    return chain_value("token", lax.create_token)


def set_chain_token(token) -> None:
    set_chain_value("token", token)


def _after(x, prev):
    """``x`` with a data dependency on ``prev`` that XLA cannot remove.

    The first element of ``x`` is XOR-ed with (first element of ``prev`` AND a
    zero that comes from a host callback): the value is unchanged bit for bit.
    """
    if x.size == 0 or prev.size == 0:
        return x
    uint = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}
    width, pwidth = uint[x.dtype.itemsize], uint[prev.dtype.itemsize]
    zero = jax.pure_callback(
        lambda: np.zeros((), width), jax.ShapeDtypeStruct((), width), vmap_method="broadcast_all"
    )
    head = lax.bitcast_convert_type(lax.slice(x, (0,), (1,)), width)
    dep = lax.bitcast_convert_type(lax.slice(prev.reshape(-1), (0,), (1,)), pwidth)
    dep = lax.convert_element_type(dep, width) & zero
    head = lax.bitcast_convert_type(head ^ _varying(dep, _vma(head)), x.dtype)
    return lax.dynamic_update_slice(x, head, (0,))

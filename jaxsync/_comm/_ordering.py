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

Imports: jax and ``_invariance`` only.
"""

from __future__ import annotations

import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core as _core
from jax._src.interpreters import batching

from ._invariance import _varying, _vma

_chains = threading.local()


def _owner():
    """The trace that owns tokens made here (vmap's traces pass values up)."""
    trace = _core.trace_ctx.trace
    while isinstance(trace, batching.BatchTrace):
        trace = trace.parent_trace
    return trace


def _ancestors(trace):
    seen = []
    while trace is not None:
        seen.append(trace)
        trace = getattr(trace, "parent_trace", None)
    return seen


def _table(trace) -> weakref.WeakKeyDictionary:
    table = getattr(_chains, "table", None)
    if table is None:
        table = _chains.table = weakref.WeakKeyDictionary()
    live = _ancestors(trace)
    for t in list(table.keys()):
        if not any(t is a for a in live):
            del table[t]
    return table


def chain_value(key: str, first):
    """The latest value of chain ``key`` in the current traced computation.

    ``first()`` makes the value the chain starts from. Eagerly (no trace) the
    chain is one concrete value per thread (a token or a byte, nothing traced).
    """
    trace = _owner()
    if isinstance(trace, _core.EvalTrace):
        value = getattr(_chains, "eager", {}).get(key)
        return first() if value is None else value
    value = _table(trace).get(trace, {}).get(key)
    return first() if value is None else value


def set_chain_value(key: str, value) -> None:
    """Record ``value`` as the latest of chain ``key`` in the current trace."""
    trace = _owner()
    if isinstance(trace, _core.EvalTrace):
        if not hasattr(_chains, "eager"):
            _chains.eager = {}
        _chains.eager[key] = value
    else:
        _table(trace).setdefault(trace, {})[key] = value


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

"""Whether an inner optimizer may run on slices: the elementwise check, and the
context that tells :func:`jaxsync.clip_by_global_norm` it runs on one.

A replica of :func:`jaxsync.sharded` holds a ``1/N`` slice of every leaf. An
optimizer whose update of an element reads only that element (and scalars:
the step count, a schedule, hyperparameters) gives on a slice exactly the
slice of its update on the whole leaf. One that reads across a leaf or the
tree (a norm, a mean, a factored moment, a sort) would see a slice only and
be silently wrong. The check traces the inner update on the slices' shapes
once, when the step is traced, and refuses any operation that mixes elements
of an operand of more than one element, naming the optax transform it comes
from (read from the traceback JAX keeps for each operation) and the way out.

Imports: jax only.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Callable

import jax
import numpy as np

# Operations that combine elements of an operand, or depend on an element's
# position: none of them commutes with cutting the leaf into slices.
_MIXING = frozenset(
    {
        "reduce_sum",
        "reduce_max",
        "reduce_min",
        "reduce_prod",
        "reduce_and",
        "reduce_or",
        "reduce_xor",
        "argmax",
        "argmin",
        "cumsum",
        "cumprod",
        "cummax",
        "cummin",
        "cumlogsumexp",
        "dot_general",
        "conv_general_dilated",
        "sort",
        "top_k",
        "fft",
        "rev",
        "gather",
        "scatter",
        "scatter-add",
        "scatter_add",
        "slice",
        "dynamic_slice",
        "dynamic_update_slice",
        "concatenate",
        "pad",
        "iota",
        "reduce_window_sum",
        "reduce_window_max",
        "reduce_window_min",
    }
)

# Sub-computations named so are jaxsync's own cross-replica reductions
# (jaxsync.clip_by_global_norm): correct on slices by construction.
GLOBAL_NAME = "_jaxsync_global_sum"

# Inside sharded's inner update: a function summing a value over every
# replica; None elsewhere. ``CHECKING`` while the check traces the update.
_ALLSUM: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "jaxsync_sharded_allsum", default=None
)


def allsum() -> Callable | None:
    """The cross-replica sum of the sharded update being traced, or None."""
    return _ALLSUM.get()


@contextlib.contextmanager
def sharded_context(fn: Callable):
    token = _ALLSUM.set(fn)
    try:
        yield
    finally:
        _ALLSUM.reset(token)


def check(update: Callable, args: tuple, what: str = "sharded") -> None:
    """Raise if ``update(*args)`` mixes elements of a slice (see the module)."""
    with sharded_context(lambda x: x):
        closed = jax.make_jaxpr(update)(*args)
    bad = _first_mixing(closed.jaxpr)
    if bad is None:
        return
    eqn, name = bad
    where = jax._src.source_info_util.summarize(eqn.source_info)
    raise ValueError(
        f"{what}: the inner optimizer's {name} is not elementwise: its "
        f"'{eqn.primitive.name}' (at {where}) reads across a leaf, and each replica "
        "holds only a 1/N slice of every leaf, so its update would be silently "
        "wrong. Fix: clip with jaxsync.clip_by_global_norm (correct on slices) "
        "instead of optax.clip_by_global_norm; chain a whole-update transform "
        "after sharded, on the gathered updates (optax.chain(jaxsync.sharded(...), "
        "t)); or, for LAMB, LARS, adafactor and other optimizers with per-leaf "
        "norms or factored moments, keep the whole state: optax.chain("
        "jaxsync.hierarchical_mean(...), optimizer)."
    )


def _first_mixing(jaxpr, outer=()):
    """The first mixing operation and its transform's name (from it or the
    operations it is nested in: a jitted helper's own trace may not know)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("pjit", "jit") and eqn.params.get("name") == GLOBAL_NAME:
            continue
        if eqn.primitive.name in _MIXING and _big(eqn):
            for e in (eqn, *outer):
                name = _transform_name(e)
                if name is not None:
                    return e, name
            return eqn, "update"
        for sub in _subjaxprs(eqn):
            got = _first_mixing(sub, (eqn, *outer))
            if got is not None:
                return got
    return None


def _big(eqn) -> bool:
    avals = [v.aval for v in eqn.invars if hasattr(v, "aval")]
    if eqn.primitive.name == "iota":
        avals = [v.aval for v in eqn.outvars]
    return any(int(np.prod(getattr(a, "shape", ()))) > 1 for a in avals)


def _subjaxprs(eqn):
    for p in eqn.params.values():
        for v in p if isinstance(p, (tuple, list)) else (p,):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jax.extend.core.Jaxpr):
                yield v


_FACTORY = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\.<locals>\.(update_fn|init_fn)")


def _transform_name(eqn) -> str | None:
    """The optax factory whose update made ``eqn`` (innermost), if known."""
    tb = eqn.source_info.traceback
    for frame in tb.frames if tb is not None else ():
        m = _FACTORY.match(frame.function_name)
        if m:
            return m.group(1)
    return None

"""Whether an inner optimizer may run on slices: the elementwise check, and the
context that tells :func:`jaxsync.clip_by_global_norm` it runs on one.

A replica of :func:`jaxsync.sharded` holds a ``1/N`` slice of every leaf. An
optimizer whose update of an element reads only that element (and scalars:
the step count, a schedule, hyperparameters) gives on a slice exactly the
slice of its update on the whole leaf. One that reads across a leaf or the
tree (a norm, a mean, a factored moment, a sort, a decomposition) would see a
slice only and be silently wrong.

The check traces the inner update on the slices' shapes once, when the step
is traced, and follows the data: the values that come from a slice (the
gradients, the parameters, the state's per-replica leaves, and whatever is
computed from them) may only go through the operations of ``ALLOWED``
(elementwise arithmetic, comparisons, selects, casts, and the reshapes and
broadcasts that keep each element where it is), or into calls (``jit``,
``custom_jvp``...) and ``cond`` branches, which are followed inside. Any other
operation reading one is refused, whatever its size (a one-element slice is
not its leaf), naming the operation and the optax transform it comes from
(read from the traceback JAX keeps for each operation) and the way out. What
reads only scalars and constants (the step count, a schedule's boundaries) is
the same on every replica and may do anything.

Imports: jax only.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Callable, Sequence

import jax
from jax.extend import core as _jcore

# Operations that map each element of their operands to the element at the same
# place of their result (operands broadcast alike): they commute with cutting
# a leaf into slices. An allow list: anything else is refused on a slice.
ALLOWED = frozenset(
    {
        # arithmetic
        *("abs", "add", "sub", "mul", "div", "rem", "neg", "sign", "max", "min", "pow"),
        *("integer_pow", "square", "sqrt", "rsqrt", "cbrt", "exp", "exp2", "expm1", "log"),
        *("log1p", "logistic", "tanh", "sinh", "cosh", "asinh", "acosh", "atanh", "sin"),
        *("cos", "tan", "asin", "acos", "atan", "atan2", "erf", "erfc", "erf_inv", "lgamma"),
        *("digamma", "floor", "ceil", "round", "nextafter", "clamp", "real", "imag", "conj"),
        *("is_finite", "reduce_precision", "copy", "copy_p", "optimization_barrier"),
        # comparisons, logic, selects, casts
        *("eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor", "select_n"),
        *("convert_element_type", "bitcast_convert_type", "stop_gradient", "pvary"),
        # the element stays where it is: a slice's order is its leaf's
        *("reshape", "squeeze", "expand_dims", "broadcast_in_dim"),
    }
)
# Calls whose body is followed (a slice's values through their arguments).
_CALLS = frozenset(
    {"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
     "custom_vjp_call_jaxpr", "remat", "checkpoint", "custom_lin"}
)  # fmt: skip

# Sub-computations named so are jaxsync's own cross-replica reductions
# (jaxsync.clip_by_global_norm): correct on slices by construction, and their
# results (summed over every replica) the same on every replica.
GLOBAL_NAME = "_jaxsync_global_sum"

# Inside sharded's inner update: a function summing a value over every
# replica; None elsewhere.
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


def check(
    update: Callable, args: tuple, what: str = "sharded", sliced: Sequence[bool] | None = None
) -> None:
    """Raise if ``update(*args)`` mixes elements of a slice (see the module).

    ``sliced``: per leaf of ``args`` (flattened), whether it is a slice; every
    leaf when None.
    """
    with sharded_context(lambda x: x):
        closed = jax.make_jaxpr(update)(*args)
    n = len(closed.jaxpr.invars)
    flags = [True] * n if sliced is None else [bool(f) for f in sliced]
    if len(flags) != n:
        raise AssertionError(f"{what}: {len(flags)} slice flags for {n} arguments")
    bad, _ = _walk(closed.jaxpr, flags, ())
    if bad is None:
        return
    eqn, name, where = bad
    raise ValueError(
        f"{what}: the inner optimizer's {name} is not elementwise: its "
        f"'{eqn.primitive.name}' (at {where}) reads a value computed from a slice, "
        "and each replica holds only a 1/N slice of every leaf, so its update would "
        "be silently wrong (an elementwise optimizer reads only its own element, "
        "the step count and scalars). Fix: clip with jaxsync.clip_by_global_norm "
        "(correct on slices) instead of optax.clip_by_global_norm; chain a "
        "whole-update transform after sharded, on the gathered updates (optax.chain("
        "jaxsync.sharded(...), t)); or, for LAMB, LARS, adafactor, spectral norms and "
        "other optimizers with per-leaf norms, decompositions or factored moments, "
        "keep the whole state: optax.chain(jaxsync.hierarchical_mean(...), optimizer)."
    )


def _walk(jaxpr, flags, outer):
    """``(bad, outs)``: the first operation not in ``ALLOWED`` that reads a
    slice's value, with its transform's name (from it or the calls it is nested
    in: a jitted helper's own trace may not know), or None; and which outputs
    of ``jaxpr`` hold a slice's values. ``flags``: per invar, whether it does."""
    tainted = {v for v, f in zip(jaxpr.invars, flags) if f}
    for eqn in jaxpr.eqns:
        reads = [_is(v, tainted) for v in eqn.invars]
        if not any(reads):
            continue  # only scalars, constants, the count: the same on every replica
        prim = eqn.primitive.name
        if prim in _CALLS and eqn.params.get("name") == GLOBAL_NAME:
            continue  # summed over every replica: not a slice's any more
        if prim in ALLOWED:
            outs = [True] * len(eqn.outvars)
        elif prim in _CALLS or prim == "cond":
            bad, outs = _inside(eqn, reads, (eqn, *outer))
            if bad is not None:
                return bad, []
        else:
            return _named(eqn, outer), []
        tainted.update(v for v, f in zip(eqn.outvars, outs) if f)
    return None, [_is(v, tainted) for v in jaxpr.outvars]


def _inside(eqn, reads, outer):
    """A call's or cond's body followed, as ``_walk`` (a body not found, or a
    branch chosen by a slice's values, is refused)."""
    if eqn.primitive.name == "cond":
        if reads[0]:  # the branch taken would depend on a slice's values
            return _named(eqn, outer[1:]), []
        bodies, flags = list(eqn.params["branches"]), reads[1:]
    else:
        bodies = [b for b in _subjaxprs(eqn) if len(b.invars) == len(reads)][:1]
        flags = reads
    if not bodies:
        return _named(eqn, outer[1:]), []
    outs = [False] * len(eqn.outvars)
    for body in bodies:
        bad, marked = _walk(getattr(body, "jaxpr", body), flags, outer)
        if bad is not None:
            return bad, []
        outs = [a or b for a, b in zip(outs, marked)]
    return None, outs


def _is(v, tainted) -> bool:
    return not isinstance(v, _jcore.Literal) and v in tainted


def _named(eqn, outer):
    """``(eqn, its transform's name, where in the source)``, the name and the
    place from the calls around it where the operation's own trace lacks them."""
    name = where = None
    for e in (eqn, *outer):
        name = name or _transform_name(e)
        where = where or jax._src.source_info_util.summarize(e.source_info)
    return eqn, name or "update", where or "?"


def _subjaxprs(eqn):
    for p in eqn.params.values():
        for v in p if isinstance(p, (tuple, list)) else (p,):
            if isinstance(v, _jcore.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, _jcore.Jaxpr):
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

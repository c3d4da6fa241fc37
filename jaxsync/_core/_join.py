"""Uneven inputs: per-replica weights and the join (``weights=``, ``all_done``).

A transform made with ``weights=True`` (or ``"world"``) takes two extra
arguments in ``update``: ``weight`` (this replica's scalar, e.g. its batch's
sample count) and ``done`` (this replica has no data after this step). Its
gradients are multiplied by the weight before the sum, and four float32
values ride with them as one more small leaf of the tree, in the same packed
buffer (no extra collective): the weight, ``1 - done``, ``1`` and
``w != 0``. Their sums are the total weight ``W``, the replicas still training
``A``, the replica count ``N`` and the count of non-zero weights ``Z``; the
mean is ``sum(w g) / W`` (``weights=True``: non-finite where ``W`` is NaN or 0
with non-zero weights, so the finite checks see it; zeros only where ``Z`` is
0, every weight 0) or ``sum(w g) / N`` (``"world"``: DDP's division by the
initial world size; a replica of weight 0 adds zeros). ``A`` is kept in :class:`WeightedState`, the
same on every replica, so every replica leaves its loop at the same step
(:func:`all_done`). Double buffering keeps the extra leaf with the delayed
gradients; ``sharded`` sums the four values in one small allreduce of its own
(its reduce-scatter gives each replica a slice, not the whole buffer), and so
does every mean with a lossy wire (``comm_dtype``: 16-bit or ``Quantized``,
which would round them) but double buffering. The
compressing means (``powersgd_mean``, ``sign_mean``) sum them first, in one
small sync of their own, and scale each replica's gradients by ``w N / W``
before their unweighted mean (:func:`prescaled`).

Imports: ``_plan`` (the reduced dtypes), ``_sync`` (the mean's predivide), ``_intra``.
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxsync._comm import _intra

from . import _sync
from ._options import (  # noqa: F401 (the options' checks, used here and re-exported)
    EarlyTermination,
    Weights,
    check_early_termination,
    check_weights,
)
from ._plan import REDUCED_DTYPES


class WeightedState(NamedTuple):
    """State of a transform made with ``weights=True`` or ``"world"``.

    Attributes:
      inner: the state the transform has without weights
        (``optax.EmptyState()``, :class:`jaxsync.SyncState`,
        :class:`jaxsync.DoubleBufferState` or :class:`jaxsync.ShardedState`).
      active: int32, how many replicas passed ``done=False`` in the last
        synchronised step (with double buffering: the step before); 0 when every
        replica is done (:func:`jaxsync.all_done`); -1 before the first step. The
        same on every replica.
      weight: float32, the sum of the replicas' weights in that step.
    """

    inner: Any
    active: jax.Array
    weight: jax.Array


def early_termination_error(done: int, n: int) -> RuntimeError:
    """The error of a step where ``done`` of ``n`` replicas have no more data."""
    return RuntimeError(
        f"jaxsync: early termination: {done} of {n} replicas passed done=True (no data "
        f"after this step) while {n - done} still have data, and the transform was made "
        "with early_termination='raise' (Horovod's throw_on_early_termination): every "
        "replica raises here instead of continuing with the finished replicas' zeros. "
        "Fix: give every replica the same number of batches (drop the uneven last "
        "ones), or early_termination='join' (the default) to let the finished replicas "
        "join at weight 0 until jaxsync.all_done."
    )


def _raise_if_early(active, count) -> None:
    """Raise :func:`early_termination_error` on every replica where some but not
    all replicas are done (``0 < active < count``: the same on every replica)."""

    def check(active, count):
        a, c = np.round(np.asarray(active)).ravel(), np.round(np.asarray(count)).ravel()
        bad = (a > 0) & (a < c)
        if bad.any():
            i = int(np.argmax(bad))
            raise early_termination_error(int(c[i] - a[i]), int(c[i]))

    jax.debug.callback(check, active, count)


def all_done(state: Any) -> jax.Array:
    """Whether every replica passed ``done=True`` in the last synchronised step.

    Finds the :class:`jaxsync.WeightedState` in an optimizer state (an
    ``optax.chain``'s tuple too) and returns ``active == 0``: a boolean scalar,
    the same on every replica, so every replica leaves its loop at the same step.

    Args:
      state: an optimizer state holding one :class:`jaxsync.WeightedState`.

    Returns:
      a boolean scalar array.

    Raises:
      ValueError: no transform of the state was made with ``weights=``.

    Example:
      >>> import jax.numpy as jnp, optax, jaxsync
      >>> tx = optax.chain(jaxsync.flat_mean(None, comm=None, weights=True),
      ...                  optax.sgd(0.5))
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> bool(jaxsync.all_done(state))
      False
      >>> u, state = tx.update({"w": jnp.ones(2)}, state, weight=3.0, done=True)
      >>> bool(jaxsync.all_done(state)), u["w"].tolist()
      (True, [-0.5, -0.5])
    """
    found = [
        s
        for s in jax.tree.leaves(state, is_leaf=lambda n: isinstance(n, WeightedState))
        if isinstance(s, WeightedState)
    ]
    if len(found) != 1:
        raise ValueError(
            f"all_done: expected one WeightedState in the optimizer state, found "
            f"{len(found)}. Fix: make exactly one synchronising transform with "
            "weights=True or weights='world', and pass its (chain's) state."
        )
    return found[0].active == 0


def extras(weight, done, axes=()):
    """``(w, extra)``: this replica's weight as float32 (1 when not given) and
    the float32 ``[w, 1 - done, 1, w != 0]`` that travels with the gradients (typed
    varying over ``axes``, so each replica counts once)."""
    w = jnp.asarray(1.0 if weight is None else weight)
    d = jnp.asarray(False if done is None else done)
    if w.ndim or d.ndim or d.dtype != jnp.bool_ or not jnp.issubdtype(w.dtype, jnp.number):
        raise ValueError(
            f"update: weight= must be a real scalar and done= a boolean scalar per "
            f"replica, got weight {w.dtype}{list(w.shape)} and done {d.dtype}{list(d.shape)}. "
            "Fix: pass each replica's own scalars (e.g. weight=jnp.float32(batch_size), "
            "done=jnp.bool_(no_more_data)); under shard_map, their per-device values."
        )
    one = jnp.ones((), jnp.float32)
    if axes:  # an axis index: varying under shard_map, batched under vmap
        one = (lax.axis_index(axes) * 0 + 1).astype(jnp.float32)
    w = w.astype(jnp.float32) * one
    return w, jnp.stack([w, jnp.where(d, 0.0, one), one, jnp.where(w != 0, one, 0.0)])


def scale(tree, w, pre=lambda dtype: 1.0):
    """Each reduced leaf times ``w / pre(dtype)`` (exactly 0 where ``w`` is 0,
    even NaN): the weight and the mean's predivide in one pass."""

    def one(g):
        if str(g.dtype) not in REDUCED_DTYPES:
            return g
        f = (w / pre(g.dtype)).astype(g.dtype)
        return jnp.where(w != 0, g * f, jnp.zeros_like(g))

    return jax.tree.map(one, tree)


def replicas(cfg) -> int:
    """The replica count of a sync with ``cfg`` (at trace time)."""
    _intra.check_axes(cfg.axes)
    return _intra.AxisOps(cfg.axes).size * cfg.backend.size()


def finish(tree, weights, reduce: str, summed, pre, n: int):
    """The summed ``tree`` (each leaf scaled by ``1 / pre(dtype)`` before the sum)
    divided by ``W`` (``weights=True``) or ``n`` (``"world"``), or (a sum) the
    predivide multiplied back. With a power-of-two predivide ``n``, ``sum / n``
    divided by ``W / n`` is exactly ``sum / W`` (both scaled by a power of two)."""

    def each(x, d):
        if str(x.dtype) not in REDUCED_DTYPES:
            return x
        p = pre(x.dtype)
        if d is None:  # a sum
            return x if p == 1.0 else x * jnp.asarray(p, x.dtype)
        if isinstance(d, float) and d == p:
            return x
        if isinstance(d, float):
            return divide(x, jnp.asarray(d / p, jnp.float32)).astype(x.dtype)
        return divide(x, (jnp.asarray(d[0], jnp.float32) / p, d[1])).astype(x.dtype)

    if reduce != "mean":
        return jax.tree.map(lambda x: each(x, None), tree)
    if weights == "world":
        return jax.tree.map(lambda x: each(x, float(n)), tree)
    # Divided in every step: a cond that skips it where W == n copies every leaf
    # (XLA's conditional), where the division fuses into the optimizer's pass.
    return jax.tree.map(lambda x: each(x, divisor(weights, reduce, summed)), tree)


def divisor(weights, reduce: str, summed):
    """What the summed gradients are divided by: ``(W, some)`` (``some``: a
    weight is non-zero), ``(N, True)`` or None (a sum)."""
    if reduce != "mean":
        return None
    if weights is True:
        return summed[0], summed[3] > 0
    return summed[2], jnp.bool_(True)


def divide(piece, div):
    """``piece / d`` for ``div = (d, some)`` (float32 for 16-bit data), 0 where
    ``some`` is False (every weight 0), or ``piece`` as it is where ``div`` is
    None. A ``d`` of NaN, or 0 with non-zero weights, gives non-finite values
    (``sum(w g) / W`` as IEEE has it), which the finite checks see; a scalar
    ``d`` is used as it is."""
    if div is None:
        return piece
    d, some = div if isinstance(div, tuple) else (div, jnp.bool_(True))
    wide = jnp.float32 if str(piece.dtype) in ("float16", "bfloat16") else piece.dtype
    d = jnp.asarray(d).astype(wide)
    out = piece.astype(wide) / jnp.where(some, d, jnp.ones_like(d))
    return jnp.where(some, out, jnp.zeros_like(out))


# sharded's divisor while its update runs (``zero/_transform.py`` reads it).
DIVISOR: contextvars.ContextVar = contextvars.ContextVar("jaxsync_divisor", default=None)


def _check_state(fn: str, state) -> None:
    if not isinstance(state, WeightedState):
        raise TypeError(
            f"{fn}: update got a state of type {type(state).__name__}, expected "
            "WeightedState from this transform's init (weights=). Make sure you "
            "have called init first and pass the state returned by this transform."
        )


def transform(fn: str, cfg, weights, make_fns, allsum=None, early_termination="join"):
    """The weighted ``GradientTransformationExtraArgs`` of a transform.

    ``make_fns(cfg)`` gives the unweighted ``(init, update)``. Without
    ``allsum`` the extra leaf rides in the tree, whose sum (``reduce="sum"``)
    this divides; with it (``sharded``), ``allsum`` sums the extra leaf and the
    transform divides by :data:`DIVISOR`. ``early_termination="raise"``: a step
    where some but not all replicas pass ``done=True`` raises on every replica.
    """
    check_weights(fn, weights, cfg.reduce)
    check_early_termination(fn, early_termination, weights)
    if cfg.quant is not None and cfg.double_buffering:
        raise ValueError(
            f"{fn}: weights={weights!r} with double_buffering=True keeps the weights and "
            "counts in the delayed gradients' buffer, which a quantized wire (comm_dtype="
            f"{cfg.quant!r}) would round. Fix: drop double_buffering, or use "
            "comm_dtype=jnp.bfloat16 (or None) with it."
        )
    inner_cfg = dataclasses.replace(  # both here; the agreed text shows the user's
        cfg,
        reduce="sum",
        predivide=None,
        weights=(weights, cfg.reduce, cfg.predivide, early_termination),
    )
    init_inner, update_inner = make_fns(inner_cfg)
    axes = tuple(cfg.axes) + tuple(getattr(cfg.backend, "mesh_axes", ()))

    # A lossy wire (16-bit, Quantized) would round the weights and counts (a count
    # wrongly 0 ends every replica's loop early): they travel in a small float32
    # sync of their own instead, except with double buffering, whose delayed
    # gradients keep their extra leaf (16-bit: counts exact up to 256 replicas,
    # weights to bfloat16's 8 significant bits).
    lossy = (cfg.comm_dtype is not None or cfg.quant is not None) and not cfg.double_buffering
    if lossy and not allsum:
        counts = dataclasses.replace(inner_cfg, comm_dtype=None, quant=None)
        allsum = lambda x: _sync.sync(x, counts)[0]
        alone = True
    else:
        alone = False

    def init_fn(params):
        # double buffering's pending extra leaf: weight 0, not done, one replica.
        x = jnp.array([0.0, 1.0, 1.0, 0.0], jnp.float32)
        inner = init_inner(params) if allsum else init_inner((params, x))
        if hasattr(inner, "pending"):  # DoubleBufferState: it keeps zeros of the tree
            inner = inner._replace(pending=(inner.pending[0], x))
        n = jnp.full((), -1, jnp.int32)  # no step yet: not done
        return WeightedState(inner, n, jnp.zeros((), jnp.float32))

    def update_fn(updates, state, params=None, weight=None, done=None, **extra_args):
        del extra_args  # other transforms' (optax.chain passes every one to all)
        _check_state(fn, state)
        w, x = extras(weight, done, axes)
        if alone:  # the counts exact, beside a lossy wire
            summed = allsum(x)
            n = replicas(cfg)
            pre = lambda dt: _sync._predivide(cfg, jnp.dtype(cfg.comm_dtype or dt), n)
            out, inner = update_inner(scale(updates, w, pre), state.inner, params)
            out = finish(out, weights, cfg.reduce, summed, pre, n)
        elif allsum:
            summed = allsum(x)
            reset = DIVISOR.set(divisor(weights, cfg.reduce, summed))
            try:
                out, inner = update_inner(scale(updates, w), state.inner, params)
            finally:
                DIVISOR.reset(reset)
        else:
            # the mean's predivide (a power of two, float16) folded into the weight
            n = replicas(cfg)
            pre = lambda dt: _sync._predivide(cfg, jnp.dtype(cfg.comm_dtype or dt), n)
            (out, summed), inner = update_inner((scale(updates, w, pre), x), state.inner, params)
            out = finish(out, weights, cfg.reduce, summed, pre, n)
        active = jnp.round(summed[1]).astype(jnp.int32)
        if early_termination == "raise":
            _raise_if_early(summed[1], summed[2])
        return out, WeightedState(inner, active, summed[0])

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def prescaled(fn: str, cfg, weights, init_inner, update_inner):
    """``weights=`` for a mean that cannot carry the extra leaf (a compressor).

    The replicas' ``[w, 1 - done, 1, w != 0]`` are summed first (one small lossless sync
    over ``cfg``'s axes and processes), then each replica's gradients are scaled
    by ``w N / W`` (``"world"``: by ``w``) and given to the unweighted
    ``update_inner``, whose mean over the ``N`` replicas is then ``sum(w g) / W``
    up to the compressor's own error (and the rounding of ``w N / W``). In a step
    where every weight is 0 the result is zeros and the inner state (residuals,
    step count) is kept as it was; a NaN weight, or weights summing to 0 that are
    not all 0, give non-finite factors (``w N / W`` as IEEE has it), so the
    result is non-finite where the finite checks see it.
    """
    check_weights(fn, weights, cfg.reduce)
    axes = tuple(cfg.axes) + tuple(getattr(cfg.backend, "mesh_axes", ()))
    counts = dataclasses.replace(  # the agreed text shows the user's weights
        cfg,
        reduce="sum",
        predivide=None,
        comm_dtype=None,
        weights=(weights, cfg.reduce, cfg.predivide),
    )

    def init_fn(params):
        n = jnp.full((), -1, jnp.int32)  # no step yet: not done
        return WeightedState(init_inner(params), n, jnp.zeros((), jnp.float32))

    def update_fn(updates, state, params=None, weight=None, done=None, **extra_args):
        del extra_args
        _check_state(fn, state)
        w, x = extras(weight, done, axes)
        summed, _ = _sync.sync(x, counts)
        total = summed[0]
        some = summed[3] > 0  # a weight is non-zero (or NaN)
        f = w if weights == "world" else w * summed[2] / jnp.where(some, total, 1.0)
        out, inner = update_inner(scale(updates, f), state.inner, params)
        keep = lambda a, b: jnp.where(some, a, b)
        zero = lambda u: keep(u, jnp.zeros_like(u)) if str(u.dtype) in REDUCED_DTYPES else u
        out = jax.tree.map(zero, out)
        inner = jax.tree.map(keep, inner, state.inner)
        active = jnp.round(summed[1]).astype(jnp.int32)
        return out, WeightedState(inner, active, total)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)

"""Skipping non-finite steps on every replica at once: ``apply_if_finite`` and
``skip_not_finite`` (for ``optax.MultiSteps``).

optax's ``apply_if_finite`` and ``MultiSteps(should_skip_update_fn=
optax.skip_not_finite)`` decide on the gradients they are given. Around a
jaxsync transform those are this replica's own: a NaN that one replica alone
sees makes it alone skip (its synchronisation is inside the skipped
``lax.cond`` branch), so across processes the others wait for it forever, and
under ``shard_map`` the same code fails to trace (the branches' axis types
differ). Here the decision is made on a value that is the same on every
replica (the number of non-finite values summed over every replica, or the
``all_finite`` that a jaxsync transform with ``check_finite=True`` already
computed after its reduction), and the wrapped update runs on every replica at
every step (its synchronisation included): the result is selected with
``jnp.where``, never in a ``lax.cond`` branch.

Imports: ``_config`` (``make_config``), ``_replica`` (``replica_mean``),
``_comm._intra`` (the bound axes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxsync._comm import _intra

from ._config import AUTO, AxisName, Comm, check_transformation, make_config
from ._replica import replica_mean


def _local_bad(tree) -> jax.Array:
    """This replica's count of non-finite values (float32: exact below 2**24)."""
    counts = [
        jnp.sum(~jnp.isfinite(x)).astype(jnp.float32)
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)
    ]
    total = jnp.zeros((), jnp.float32)
    for c in counts:
        total = total + c
    return total


def _replicas(cfg) -> int:
    return _intra.axes_size(cfg.axes) * cfg.backend.size()


def global_bad(tree, cfg, axis_name, comm) -> jax.Array:
    """The number of non-finite values of ``tree`` summed over every replica
    (float32, the same on every replica): one scalar through ``replica_mean``.
    Where the step's axes are not bound (``init`` outside ``shard_map``), this
    replica's own count."""
    bad = _local_bad(tree)
    if not all(a in _intra.bound_axes() for a in cfg.axes):
        return bad
    mean = replica_mean(bad, axis_name=axis_name, comm=comm)
    return jnp.round(mean * _replicas(cfg))


def _synced_flag(state) -> Any:
    """``all_finite`` of a jaxsync state made with ``check_finite=True`` (a
    :class:`jaxsync.SyncState` or :class:`jaxsync.ShardedState`, alone or in a
    chain's tuple): computed after the reduction, the same on every replica."""
    for s in (state, *(state if isinstance(state, (tuple, list)) else ())):
        flag = getattr(s, "all_finite", None)
        if flag is not None and getattr(flag, "shape", None) == ():
            return flag
    return None


def apply_if_finite(
    inner: optax.GradientTransformation,
    max_consecutive_errors: int,
    *,
    axis_name: AxisName,
    comm: Comm = AUTO,
) -> optax.GradientTransformationExtraArgs:
    """``optax.apply_if_finite`` that skips a step on every replica at once.

    Wrap a jaxsync chain (``optax.chain(jaxsync.hierarchical_mean(...), opt)``)
    or :func:`jaxsync.sharded`: when the gradients of *any* replica hold a NaN
    or an infinity, every replica skips the step (updates zero, the wrapped
    state kept), and after ``max_consecutive_errors`` skips in a row every
    replica accepts, as optax's does. optax's own, around a synchronisation,
    skips on the replica that saw the NaN only: across processes the others
    then wait for it (a hang), and under ``shard_map`` it fails to trace.

    The wrapped update runs at every step on every replica (its
    synchronisation too); its result is selected, not branched on. The
    decision reads ``all_finite`` when the wrapped transform keeps it
    (``check_finite=True``: no extra communication), else the non-finite
    count summed over every replica (one scalar more on the wire). After a
    jaxsync mean the gradients are already the same everywhere: there
    ``optax.chain(jaxsync.hierarchical_mean(...), optax.apply_if_finite(opt, k))``
    is as safe and free.

    Args:
      inner: the transformation to wrap (its state must be the same kind on
        every replica: a jaxsync chain, or :func:`jaxsync.sharded`).
      max_consecutive_errors: how many non-finite steps in a row are skipped
        (an int >= 0).
      axis_name: the local axis name(s) of the step, as for
        :func:`jaxsync.hierarchical_mean` (``None`` under plain ``jit``).
      comm: the inter-process stage, as for :func:`jaxsync.mean`.

    Returns:
      an ``optax.GradientTransformationExtraArgs`` with optax's
      ``ApplyIfFiniteState`` (the counts are the same on every replica).

    Raises:
      ValueError: ``max_consecutive_errors`` is not an int >= 0.
      TypeError: ``inner`` is not an optax transformation.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxsync
      >>> sync = jaxsync.hierarchical_mean(axis_name="i", comm=None)
      >>> tx = jaxsync.apply_if_finite(optax.chain(sync, optax.sgd(1.0)), 3,
      ...                              axis_name="i", comm=None)
      >>> g = {"w": jnp.array([1.0, 2.0, jnp.nan, 4.0])}  # replica 2's is NaN
      >>> u, s = jax.vmap(lambda x: tx.update(x, tx.init(x)), axis_name="i")(g)
      >>> u["w"], s.notfinite_count  # every replica skipped
      (Array([0., 0., 0., 0.], dtype=float32), Array([1, 1, 1, 1], dtype=int32))
    """
    fn = "apply_if_finite"
    if isinstance(max_consecutive_errors, bool) or not isinstance(max_consecutive_errors, int):
        raise ValueError(
            f"{fn}: max_consecutive_errors must be an int >= 0, got "
            f"{max_consecutive_errors!r}. Fix: e.g. jaxsync.apply_if_finite(tx, 5, axis_name=...)."
        )
    if max_consecutive_errors < 0:
        raise ValueError(
            f"{fn}: max_consecutive_errors must be >= 0, got {max_consecutive_errors}. "
            "Fix: 0 skips nothing twice in a row; e.g. 5."
        )
    check_transformation(
        fn,
        "inner",
        inner,
        "jaxsync.apply_if_finite(optax.chain(jaxsync.hierarchical_mean(...), "
        "optax.adam(1e-3)), 5, axis_name=...)",
    )
    cfg = make_config(fn, "hierarchical", axis_name, comm)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return optax.ApplyIfFiniteState(
            notfinite_count=jnp.zeros([], jnp.int32),
            last_finite=jnp.array(True, jnp.bool_),
            total_notfinite=jnp.zeros([], jnp.int32),
            inner_state=inner.init(params),
        )

    def update_fn(updates, state, params=None, **extra_args):
        # Every replica runs the wrapped update (and its synchronisation).
        new_updates, new_inner = inner.update(updates, state.inner_state, params, **extra_args)
        flag = _synced_flag(new_inner)
        finite = flag if flag is not None else global_bad(updates, cfg, axis_name, comm) == 0
        count = jnp.where(finite, 0, optax.safe_increment(state.notfinite_count))
        accept = jnp.logical_or(finite, count > max_consecutive_errors)
        out = jax.tree.map(lambda u: jnp.where(accept, u, jnp.zeros_like(u)), new_updates)
        kept = jax.tree.map(
            lambda n, o: jnp.where(accept, n, o).astype(o.dtype), new_inner, state.inner_state
        )
        total = jnp.where(
            finite, state.total_notfinite, optax.safe_increment(state.total_notfinite)
        )
        return out, optax.ApplyIfFiniteState(count, finite, total, kept)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def skip_not_finite(*, axis_name: AxisName, comm: Comm = AUTO) -> Callable[..., Any]:
    """``optax.skip_not_finite`` decided on every replica's gradients at once.

    For ``optax.MultiSteps(tx, k, should_skip_update_fn=...)`` around a jaxsync
    chain: a micro-step whose gradients hold a NaN or an infinity on *any*
    replica is dropped on every replica (as if it never happened: the
    accumulation's boundary moves by one micro-step everywhere). With optax's
    own, only the replica that saw it drops it: its boundary shifts, and the
    others wait for it at their next synchronisation (a hang). One scalar per
    micro-step travels (the count of non-finite values, summed over every
    replica).

    Args:
      axis_name: the local axis name(s) of the step, as for
        :func:`jaxsync.hierarchical_mean` (``None`` under plain ``jit``).
      comm: the inter-process stage, as for :func:`jaxsync.mean`.

    Returns:
      a ``should_skip_update_fn`` taking ``(updates, gradient_step, params)``
      and giving ``should_skip`` and ``{"should_skip", "num_not_finite"}``,
      the same on every replica (the count is over every replica, float32).

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxsync
      >>> sync = jaxsync.hierarchical_mean(axis_name="i", comm=None)
      >>> skip = jaxsync.skip_not_finite(axis_name="i", comm=None)
      >>> tx = optax.MultiSteps(optax.chain(sync, optax.sgd(1.0)), 2,
      ...                       should_skip_update_fn=skip)
      >>> g = {"w": jnp.array([1.0, jnp.inf, 3.0, 4.0])}
      >>> with jax.numpy_dtype_promotion("standard"):  # MultiSteps mixes int and float
      ...     _, s = jax.vmap(lambda x: tx.update(x, tx.init(x)), axis_name="i")(g)
      >>> s.mini_step, s.skip_state["num_not_finite"]  # dropped everywhere
      (Array([0, 0, 0, 0], dtype=int32), Array([1., 1., 1., 1.], dtype=float32))
    """
    cfg = make_config("skip_not_finite", "hierarchical", axis_name, comm)

    def should_skip(updates, gradient_step, params):
        del gradient_step, params
        bad = global_bad(updates, cfg, axis_name, comm)
        skip = bad > 0
        return skip, {"should_skip": skip, "num_not_finite": bad}

    return should_skip

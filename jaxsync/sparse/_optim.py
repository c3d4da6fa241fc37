"""Applying row-sparse updates: ``densify``, ``sparse_sgd``, ``sparse_adagrad``,
``apply_sparse_updates``.

Optimizers that keep :class:`RowSparse` updates sparse (only the touched rows
are read and written) and the transform that turns them dense for any optax
optimizer.

May import: ``_sparse`` (the type, ``_coalesce``); JAX and optax. Nothing that
synchronises.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ._rows import RowSparse, _coalesce, _is_rs

PyTree = Any


def _dense(x):
    return x.todense() if _is_rs(x) else x


def densify() -> optax.GradientTransformation:
    """Turn ``RowSparse`` leaves into dense arrays (other leaves pass through).

    Put it between a jaxsync strategy and a dense optimizer:
    ``optax.chain(jaxsync.hierarchical_mean(...), jaxsync.densify(), optax.adam(...))``.

    Returns:
      a stateless ``optax.GradientTransformation`` (its state is
      ``optax.EmptyState()``).

    Example:
      >>> import jax.numpy as jnp, optax, jaxsync
      >>> tx = optax.chain(jaxsync.densify(), optax.sgd(1.0))
      >>> g = {"emb": jaxsync.RowSparse(jnp.array([1]), jnp.ones((1, 2)), 3)}
      >>> params = {"emb": jnp.zeros((3, 2))}
      >>> tx.update(g, tx.init(params), params)[0]["emb"]
      Array([[-0., -0.],
             [-1., -1.],
             [-0., -0.]], dtype=float32)
    """

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None):
        del params
        return jax.tree.map(_dense, updates, is_leaf=_is_rs), state

    return optax.GradientTransformation(init_fn, update_fn)


def _check_lr(fn, learning_rate):
    if callable(learning_rate):
        return
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float)):
        raise TypeError(
            f"{fn} got unexpected type for argument 'learning_rate' (expected: a float "
            f"or an optax schedule, got: {type(learning_rate).__name__} "
            f"{learning_rate!r}). Fix: learning_rate=0.1."
        )
    if not learning_rate > 0:
        raise ValueError(
            f"{fn}: learning_rate must be > 0, got {learning_rate}. Fix: learning_rate=0.1."
        )


class ScheduleState(NamedTuple):
    """Step count of a sparse optimizer (for a learning-rate schedule)."""

    count: jax.Array  # type: ignore[assignment]  # shadows tuple.count


def _lr(learning_rate, count):
    return learning_rate(count) if callable(learning_rate) else learning_rate


def sparse_sgd(learning_rate: optax.ScalarOrSchedule) -> optax.GradientTransformation:
    """SGD that keeps ``RowSparse`` updates sparse: only touched rows change.

    Dense leaves get ``-learning_rate * g``; ``RowSparse`` leaves get a
    ``RowSparse`` of ``-learning_rate * values``. Apply the updates with
    :func:`jaxsync.apply_sparse_updates` (a scatter-add of the ``k`` rows).

    Args:
      learning_rate: a float > 0 or an optax schedule (no default, as for
        ``optax.sgd``).

    Returns:
      an ``optax.GradientTransformation`` whose state is a
      :class:`ScheduleState` (the step count).

    Raises:
      TypeError, ValueError: ``learning_rate`` is not a float > 0 or a callable.

    Example:
      >>> import jax.numpy as jnp, jaxsync
      >>> tx = jaxsync.sparse_sgd(0.5)
      >>> params = {"emb": jnp.zeros((3, 2))}
      >>> g = {"emb": jaxsync.RowSparse(jnp.array([2]), jnp.ones((1, 2)), 3)}
      >>> upd, _ = tx.update(g, tx.init(params), params)
      >>> jaxsync.apply_sparse_updates(params, upd)["emb"][2]
      Array([-0.5, -0.5], dtype=float32)
    """
    _check_lr("sparse_sgd", learning_rate)

    def init_fn(params):
        del params
        return ScheduleState(count=jnp.zeros((), jnp.int32))

    def update_fn(updates, state, params=None):
        del params
        lr = _lr(learning_rate, state.count)

        def one(g):
            if _is_rs(g):
                v = g.values * jnp.asarray(-lr, g.values.dtype)
                return RowSparse.tree_unflatten(g.num_rows, (g.indices, v))
            return g * jnp.asarray(-lr, g.dtype)

        return (jax.tree.map(one, updates, is_leaf=_is_rs), ScheduleState(count=state.count + 1))

    return optax.GradientTransformation(init_fn, update_fn)


class SparseAdagradState(NamedTuple):
    """Sum of squared gradients (dense, like the parameters) and the step count."""

    sum_of_squares: PyTree
    count: jax.Array  # type: ignore[assignment]  # shadows tuple.count


def sparse_adagrad(
    learning_rate: optax.ScalarOrSchedule, initial_accumulator_value: float = 0.1, eps: float = 1e-7
) -> optax.GradientTransformation:
    """Adagrad that reads and writes only the touched rows (Caffe2's SparseAdagrad).

    The accumulator of a ``RowSparse`` leaf is dense like its table, but each
    step sums duplicate indices first, then updates only those rows of the
    accumulator and returns a ``RowSparse`` update (apply it with
    :func:`jaxsync.apply_sparse_updates`). Every leaf, dense or sparse, is
    updated by Caffe2's rule ``-learning_rate * g / (sqrt(acc) + eps)``
    (``optax.adagrad`` puts ``eps`` inside the root instead).

    Args:
      learning_rate: a float > 0 or an optax schedule (no default, as for
        ``optax.adagrad``).
      initial_accumulator_value: starting value of the accumulators (>= 0).
      eps: added to the square root of the accumulator (>= 0).

    Returns:
      an ``optax.GradientTransformation`` whose state is a
      :class:`SparseAdagradState` (dense accumulators and the step count).

    Raises:
      TypeError, ValueError: an argument is of the wrong type or out of range.

    Example:
      >>> import jax.numpy as jnp, jaxsync
      >>> tx = jaxsync.sparse_adagrad(1.0, initial_accumulator_value=0.0, eps=0.0)
      >>> params = {"emb": jnp.zeros((3, 1))}
      >>> g = {"emb": jaxsync.RowSparse(jnp.array([1, 1]), jnp.array([[1.], [1.]]), 3)}
      >>> upd, state = tx.update(g, tx.init(params), params)
      >>> jaxsync.apply_sparse_updates(params, upd)["emb"][:, 0]
      Array([ 0., -1.,  0.], dtype=float32)
      >>> state.sum_of_squares["emb"][:, 0]
      Array([0., 4., 0.], dtype=float32)
    """
    _check_lr("sparse_adagrad", learning_rate)
    for name, val, lo in (
        ("initial_accumulator_value", initial_accumulator_value, 0.0),
        ("eps", eps, 0.0),
    ):
        if isinstance(val, bool) or not isinstance(val, (int, float)) or not val >= lo:
            raise ValueError(
                f"sparse_adagrad: {name} must be a float >= {lo}, got {val!r}. Fix: {name}=0.1."
            )

    def init_fn(params):
        acc = jax.tree.map(lambda p: jnp.full(p.shape, initial_accumulator_value, p.dtype), params)
        return SparseAdagradState(sum_of_squares=acc, count=jnp.zeros((), jnp.int32))

    def update_fn(updates, state, params=None):
        del params
        lr = _lr(learning_rate, state.count)

        def one(g, acc):
            if _is_rs(g):
                c = _coalesce(g, size=min(g.k, g.num_rows))
                rows = acc.at[c.indices].get(mode="fill", fill_value=0) + c.values**2
                acc = acc.at[c.indices].set(rows, mode="drop")
                upd = -lr * c.values / (jnp.sqrt(rows) + eps)
                return RowSparse.tree_unflatten(g.num_rows, (c.indices, upd.astype(g.dtype))), acc
            acc = acc + g * g
            return (-lr * g / (jnp.sqrt(acc) + eps)).astype(g.dtype), acc

        flat_g, gdef = jax.tree_util.tree_flatten(updates, is_leaf=_is_rs)
        flat_a = gdef.flatten_up_to(state.sum_of_squares)
        pairs = [one(g, a) for g, a in zip(flat_g, flat_a)]
        return (
            gdef.unflatten([p[0] for p in pairs]),
            SparseAdagradState(gdef.unflatten([p[1] for p in pairs]), state.count + 1),
        )

    return optax.GradientTransformation(init_fn, update_fn)


def apply_sparse_updates(params: PyTree, updates: PyTree) -> PyTree:
    """``optax.apply_updates`` that scatter-adds ``RowSparse`` updates.

    Only the ``k`` rows of a sparse update are read and written (in place when
    the step donates ``params``); indices outside ``[0, num_rows)`` are dropped.

    Args:
      params: the parameter pytree.
      updates: updates of the same structure (a leaf may be a ``RowSparse``
        of the leaf's shape, or ``None`` for no change).

    Returns:
      the updated parameters, each leaf in its parameter's dtype.

    Example:
      >>> import jax.numpy as jnp, jaxsync
      >>> upd = {"emb": jaxsync.RowSparse(jnp.array([0, 0]), jnp.ones((2, 1)), 2)}
      >>> jaxsync.apply_sparse_updates({"emb": jnp.zeros((2, 1))}, upd)["emb"][:, 0]
      Array([2., 0.], dtype=float32)
    """
    flat_u, udef = jax.tree_util.tree_flatten(updates, is_leaf=_is_rs)
    flat_p = udef.flatten_up_to(params)  # type: ignore[attr-defined]

    def one(p, u):
        if u is None:
            return p
        if _is_rs(u):
            idx = jnp.where(u.valid(), u.indices, u.num_rows)
            return p.at[idx].add(u.values.astype(p.dtype), mode="drop")
        return (jnp.asarray(p) + u).astype(jnp.asarray(p).dtype)

    return jax.tree_util.tree_unflatten(udef, [one(p, u) for p, u in zip(flat_p, flat_u)])

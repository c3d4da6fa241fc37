"""Compressed gradient synchronisation with error feedback, as optax state.

Two transforms, each an ordinary ``optax.GradientTransformation`` whose state
(a pytree: checkpoint it with the rest of the optimizer state) holds the
error-feedback residuals:

* :func:`powersgd_mean`: PowerSGD (Vogels et al., 2019). Every matrix-shaped
  leaf ``M`` (the leaf reshaped to ``(prod(shape[:-1]), shape[-1])``: the last
  axis, the output features of flax's ``Dense`` and ``Conv`` kernels, against
  the rest) is approximated by ``P Q^T`` of rank ``r``: ``P = M Q`` is averaged
  over every replica, orthogonalised, ``Q = M^T P`` is averaged, and the
  residual ``M - P Q^T`` is added to the next step's gradient. Both averages go
  through jaxsync's hierarchical path (local axes, then processes), together
  with the leaves that are not compressed.
* :func:`sign_mean`: scaled sign compression with worker-side error feedback
  (EF-SignSGD, Karimireddy et al., 2019): each replica sends the signs of
  ``g + e`` packed 8 per byte and one float32 scale (the mean absolute value)
  per leaf, through one all-gather over the local axes and one across
  processes; every replica unpacks all of them and sums them in the same
  order, so replicas stay bit-identical.

The residuals differ from replica to replica (they are each replica's own
error): under ``shard_map`` their state leaves are per-device values; see
:func:`state_specs`.

This module holds what both transforms share: their states,
:func:`state_specs`, the checks of their arguments and trees, and the layout
rules (which leaves each compresses; the compression bench reads them too). The
transforms live in ``_powersgd`` and ``_sign``; ``_compress_phase`` switches
from exact to compressed averages at ``start_step``.

May import: ``_config`` (``_bad_type``, the error format of every factory)
and ``_sparse`` (to reject ``RowSparse`` leaves); JAX, optax, numpy.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from . import _config
from ._sparse import RowSparse

PyTree = Any
_FLOATS = ("float16", "bfloat16", "float32", "float64")


class PowerSGDState(NamedTuple):
    """State of :func:`powersgd_mean`.

    Attributes:
      count: int32 scalar, the number of updates so far (the same on every
        replica).
      q: one float32 ``(m, r)`` matrix per compressed leaf: the warm-start
        ``Q`` (the same on every replica).
      residual: one array per compressed leaf, the leaf's shape (float32 for
        16-bit leaves): this replica's error feedback (different on every
        replica).
    """

    count: jax.Array  # type: ignore[assignment]  # shadows tuple.count
    q: tuple
    residual: tuple


class SignState(NamedTuple):
    """State of :func:`sign_mean`.

    Attributes:
      count: int32 scalar, the number of updates so far.
      residual: one array per compressed leaf (float32 for 16-bit leaves):
        this replica's error feedback (different on every replica).
    """

    count: jax.Array  # type: ignore[assignment]  # shadows tuple.count
    residual: tuple


def state_specs(state: PyTree, axis_name: str | tuple[str, ...]) -> PyTree:
    """``PartitionSpec``s for an optimizer state holding compression residuals.

    Residuals are each replica's own values: under ``jax.shard_map`` they must
    enter and leave the step split over the local axes (``P(axis_name)``: the
    global array stacks every device's residual along its first axis), while
    everything else in the state is replicated (``P()``). Make the state inside
    ``shard_map`` with these specs, so each device starts with its own zeros.

    Args:
      state: an optimizer state, or its ``jax.eval_shape`` structure.
      axis_name: the local axis name(s) of the step.

    Returns:
      a pytree of ``PartitionSpec`` with the structure of ``state``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxsync
      >>> tx = optax.chain(jaxsync.sign_mean(axis_name="d", comm=None, min_size=1),
      ...                  optax.sgd(0.1))
      >>> shapes = jax.eval_shape(tx.init, {"w": jnp.zeros((4, 3))})
      >>> specs = jaxsync.state_specs(shapes, "d")
      >>> specs[0].residual, specs[0].count
      ((P('d',),), P())
    """
    per_replica = PartitionSpec(axis_name)
    replicated = PartitionSpec()

    def one(node):
        if isinstance(node, PowerSGDState):
            return PowerSGDState(
                replicated,
                tuple(replicated for _ in node.q),
                tuple(per_replica for _ in node.residual),
            )
        if isinstance(node, SignState):
            return SignState(replicated, tuple(per_replica for _ in node.residual))
        return replicated

    return jax.tree_util.tree_map(
        one, state, is_leaf=lambda n: isinstance(n, (PowerSGDState, SignState))
    )


# --------------------------------------------------------------------------
# Validation


def _check_int(fn, name, value, low, fix):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise _config._bad_type(fn, name, f"an int >= {low}", value, fix)
    if value < low:
        raise ValueError(f"{fn}: {name} must be >= {low}, got {value}. Fix: {fix}.")
    return int(value)


def _check_bool(fn, name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise _config._bad_type(fn, name, "a bool", value, f"pass {name}=True or {name}=False")
    return bool(value)


def _check_float(fn, name, value, low, fix):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)):
        raise _config._bad_type(fn, name, f"a float >= {low}", value, fix)
    if not (value >= low and math.isfinite(value)):
        raise ValueError(f"{fn}: {name} must be a finite float >= {low}, got {value}. Fix: {fix}.")
    return float(value)


def _wide(dtype) -> jnp.dtype:
    """Compute (and residual) dtype: float32 for 16-bit leaves."""
    dt = jnp.dtype(dtype)
    return jnp.dtype(jnp.float32) if dt.itemsize < 4 else dt


def _is_float(x) -> bool:
    return str(jnp.dtype(x.dtype)) in _FLOATS


# --------------------------------------------------------------------------
# Which leaves each transform compresses (also read by jaxsync.bench.compress)


def _matrix_shape(shape) -> tuple[int, int]:
    return math.prod(shape[:-1]), shape[-1]


def _powersgd_layout(leaves, rank, min_rate):
    """Per leaf: ``(n, m, r)`` when compressed, else ``None``."""
    out = []
    for x in leaves:
        shape = tuple(x.shape)
        if len(shape) < 2 or not _is_float(x) or math.prod(shape) == 0:
            out.append(None)
            continue
        n, m = _matrix_shape(shape)
        r = min(rank, n, m)
        rate = (n * m) / (r * (n + m))
        out.append((n, m, r) if rate >= min_rate else None)
    return out


def _sign_layout(leaves, min_size):
    return [_is_float(x) and x.size >= max(min_size, 1) for x in leaves]


def _state_error(fn, state, expected):
    return TypeError(
        f"{fn}: update got a state of type {type(state).__name__}, expected "
        f"{expected.__name__} from this transform's init. Fix: call init first and "
        "pass the state returned by this transform (for a different gradient tree, "
        "call init again)."
    )


def _reject_row_sparse(fn, tree) -> None:
    """RowSparse leaves hold different rows on every replica: never compress them."""
    is_rs = lambda x: isinstance(x, RowSparse)  # noqa: E731
    if any(is_rs(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=is_rs)):
        raise TypeError(
            f"{fn}: the gradient tree holds a jaxsync.RowSparse leaf; its rows differ "
            "from replica to replica, so they cannot be compressed with the dense "
            "leaves. Fix: label the table for hierarchical_mean (or another exact "
            "strategy, which all-gathers its rows) with optax.partition, and this "
            "transform for the dense leaves."
        )


def _tree_error(fn, what, got, want):
    return ValueError(
        f"{fn}: the gradient tree has {got} {what}, the state was made for {want}. "
        "Fix: call init with parameters of the same structure and shapes as the "
        "gradients."
    )

"""Compressed gradient synchronisation with error feedback, as optax state.

Two transforms, each an ordinary ``optax.GradientTransformation`` whose state
(a pytree: checkpoint it with the rest of the optimizer state) holds the
error-feedback residuals:

* :func:`powersgd_mean`: PowerSGD (Vogels et al., 2019). Every matrix-shaped
  leaf ``M`` (the leaf reshaped to its first or its last axis against the rest,
  whichever saves more: the channels of flax's ``(h, w, in, out)`` and of
  equinox's ``(out, in, kh, kw)`` kernels; see ``matrix_view``) is approximated
  by ``P Q^T`` of rank ``r``: ``P = M Q`` is averaged over every replica,
  orthogonalised, ``Q = M^T P`` is averaged, and the
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

May import: ``_config`` (``_bad_type``, the error format of every factory),
``_intra`` (``bound_axes``, for the state checks) and ``_sparse`` (to reject
``RowSparse`` leaves); JAX, optax, numpy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxsync._comm import _intra
from jaxsync._core import _config
from jaxsync.sparse._rows import RowSparse

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
      owner: int32 scalar, the index of the process whose replicas own the
        residuals (the MPI rank; 0 without MPI). A state restored on another
        process (rank 0's checkpoint on every rank) has its residuals dropped
        at the next update instead of applied to this replica's gradients.
    """

    count: jax.Array  # type: ignore[assignment]  # shadows tuple.count
    q: tuple
    residual: tuple
    owner: jax.Array


class SignState(NamedTuple):
    """State of :func:`sign_mean`.

    Attributes:
      count: int32 scalar, the number of updates so far.
      residual: one array per compressed leaf, the leaf's shape (``(1,)`` for
        a scalar leaf, so that under ``shard_map`` every device's residual
        stacks along the first axis; float32 for 16-bit leaves): this
        replica's error feedback (different on every replica).
      owner: int32 scalar, the process index, as for :class:`PowerSGDState`.
    """

    count: jax.Array  # type: ignore[assignment]  # shadows tuple.count
    residual: tuple
    owner: jax.Array


def state_specs(state: PyTree, axis_name: str | tuple[str, ...]) -> PyTree:
    """``PartitionSpec``s for an optimizer state holding compression residuals.

    Residuals are each replica's own values: under ``jax.shard_map`` they must
    enter and leave the step split over the local axes (``P(axis_name)``: the
    global array stacks every device's residual along its first axis), while
    everything else in the state is replicated (``P()``). Make the state inside
    ``shard_map`` with these specs, so each device starts with its own zeros.

    The compression states are found as :class:`PowerSGDState` and
    :class:`SignState`, and also as the mappings with their field names that
    flax NNX makes of them (``nnx.state(optimizer)``). The same holds for the
    gradients a double-buffered transform keeps (``pending`` of
    :class:`jaxsync.DoubleBufferState`, ``double_buffering=True``) and the
    slices of a :class:`jaxsync.ShardedState` (:func:`jaxsync.sharded`). A scalar
    parameter's residual and pending gradient are kept as ``(1,)``, so every
    per-replica leaf has a first axis to stack the devices' values along.

    Args:
      state: an optimizer state, or its ``jax.eval_shape`` structure.
      axis_name: the local axis name(s) of the step.

    Returns:
      a pytree of ``PartitionSpec`` with the structure of ``state``.

    Raises:
      ValueError: a per-replica leaf is a scalar (a state of an older jaxsync,
        whose scalars ``P(axis_name)`` cannot split): make the state again
        with ``init``.

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
        if hasattr(node, "jaxsync_state_specs"):  # jaxsync.ShardedState
            return node.jaxsync_state_specs(per_replica, replicated)
        if not _is_compression_state(node):
            return replicated
        # A NamedTuple or (NNX) a mapping with its field names: the subtree under
        # "residual" is per replica, the rest replicated; a state inside it (a
        # quantized wire's in a DoubleBufferState) lays itself out.
        return jax.tree_util.tree_map_with_path(
            lambda path, x: (
                x.jaxsync_state_specs(per_replica, replicated)
                if hasattr(x, "jaxsync_state_specs")
                else _per_replica(path, x, per_replica)
                if _field(path[0]) in _PER_REPLICA
                else replicated
            ),
            node,
            is_leaf=lambda n: hasattr(n, "jaxsync_state_specs"),
        )

    return jax.tree_util.tree_map(
        one, state, is_leaf=lambda n: hasattr(n, "jaxsync_state_specs") or _is_compression_state(n)
    )


def _per_replica(path, leaf, spec):
    # P(axis) stacks the devices' values along a first axis: a scalar has none.
    if getattr(leaf, "ndim", None) == 0:
        raise ValueError(
            f"state_specs: the per-replica state leaf {jax.tree_util.keystr(path)} is a "
            "scalar; P(axis_name) splits a first axis, and a scalar has none (this "
            "jaxsync keeps a scalar's residual and pending gradient as shape (1,)). "
            "Fix: make the state again with tx.init (e.g. jax.eval_shape(tx.init, "
            "params) for the specs)."
        )
    return spec


# DoubleBufferState's fields (jaxsync._core._sync, which imports this module's users).
_DOUBLE_FIELDS = frozenset(("pending", "all_finite", "wire"))
_COMPRESS_FIELDS = (frozenset(PowerSGDState._fields), frozenset(SignState._fields))
_STATE_FIELDS = (*_COMPRESS_FIELDS, _DOUBLE_FIELDS, _DOUBLE_FIELDS - {"wire"})
_PER_REPLICA = ("residual", "pending")  # each replica's own values


def _is_compression_state(node) -> bool:
    if isinstance(node, (PowerSGDState, SignState)):
        return True
    if isinstance(node, tuple) and frozenset(getattr(node, "_fields", ())) == _DOUBLE_FIELDS:
        return True
    if isinstance(node, Mapping):
        try:
            return frozenset(node.keys()) in _STATE_FIELDS
        except TypeError:  # unhashable keys: not a state
            return False
    return False


def _field(key) -> Any:
    """The field name of a path's first key (a NamedTuple's or a mapping's)."""
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    if isinstance(key, jax.tree_util.DictKey):
        return key.key
    return None


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


# PowerSGD's matrix views of a leaf of >= 2 axes: ``(prod(shape[:s]), prod(shape[s:]))``.
MATRIX_VIEWS = ("auto", "last", "first")


def _rate(n: int, m: int, rank: int) -> float:
    """The factor of bytes a rank-``rank`` approximation of an n x m matrix saves."""
    r = min(rank, n, m)
    return (n * m) / (r * (n + m))


def _split(shape, view: str, rank: int) -> int:
    """How many leading axes of ``shape`` make the rows under ``view``.

    ``"last"``: the last axis against the rest (flax's ``(in, out)`` and
    ``(h, w, in, out)`` kernels); ``"first"``: the first against the rest
    (PyTorch's and equinox's ``(out, in)`` and ``(out, in, kh, kw)``);
    ``"auto"``: of those two, the one that saves more bytes, ties going to
    ``"last"`` (each layout gets its channels-against-the-rest view).
    """
    nd = len(shape)
    if view == "last":
        return nd - 1
    if view == "first":
        return 1
    return max(
        (1, nd - 1), key=lambda s: (_rate(math.prod(shape[:s]), math.prod(shape[s:]), rank), s)
    )


def _matrix_shape(shape, split: int | None = None) -> tuple[int, int]:
    s = len(shape) - 1 if split is None else split
    return math.prod(shape[:s]), math.prod(shape[s:])


def _view_of(view, path: str, shape) -> str | None:
    """The view (a name of ``MATRIX_VIEWS``) of one leaf, ``None``: sent exactly."""
    if not callable(view):
        return view
    got = view(path, tuple(shape))
    if got is not None and got not in MATRIX_VIEWS:
        raise ValueError(
            f"powersgd_mean: matrix_view({path!r}, {tuple(shape)}) returned {got!r}, expected "
            f"one of {MATRIX_VIEWS} or None (the leaf sent exactly). Fix: return e.g. 'first' "
            "for a (out, in, kh, kw) kernel."
        )
    return got


def _powersgd_layout(leaves, rank, min_rate, view="last", paths=None):
    """Per leaf: ``(n, m, r)`` when compressed, else ``None``.

    ``view``: a name of ``MATRIX_VIEWS``, or a callable ``(path, shape)`` that
    returns one (or ``None``); ``paths``: the leaves' ``keystr`` paths, which a
    callable needs.
    """
    out = []
    for k, x in enumerate(leaves):
        shape = tuple(x.shape)
        if len(shape) < 2 or not _is_float(x) or math.prod(shape) == 0:
            out.append(None)
            continue
        name = _view_of(view, "" if paths is None else paths[k], shape)
        if name is None:
            out.append(None)
            continue
        n, m = _matrix_shape(shape, _split(shape, name, rank))
        r = min(rank, n, m)
        out.append((n, m, r) if _rate(n, m, rank) >= min_rate else None)
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


def _residual_shape(shape) -> tuple:
    """A leaf's residual shape: its own, ``(1,)`` for a scalar (``P(axis)`` under
    ``shard_map`` stacks every device's residual along a first axis)."""
    return tuple(shape) or (1,)


def _check_state_shapes(fn, updates, idx, state, axes, qs=None) -> None:
    """At trace time: the residuals (and ``Q``s) of ``state`` fit the leaves ``idx``.

    ``qs``: the expected ``Q`` shapes, for PowerSGD. Static: costs nothing at run
    time. A residual whose first axis is the leaf's divided (or multiplied) by
    the local device count is a state made (or passed) outside ``shard_map``'s
    per-device specs.
    """
    bound = _intra.bound_axes()
    local = math.prod(bound.get(a, 1) for a in axes)
    with_paths = jax.tree_util.tree_flatten_with_path(updates)[0]
    checks = [
        (
            f"the residual of {jax.tree_util.keystr(with_paths[k][0]) or 'the leaf'}",
            tuple(r.shape),
            _residual_shape(with_paths[k][1].shape),
        )
        for k, r in zip(idx, state.residual)
    ]
    if qs is not None:
        checks += [
            (
                f"the Q of {jax.tree_util.keystr(with_paths[k][0]) or 'the leaf'}",
                tuple(q.shape),
                want,
            )
            for k, q, want in zip(idx, state.q, qs)
        ]
    for what, got, want in checks:
        if got == want:
            continue
        if (
            local > 1
            and len(got) == len(want)
            and got[1:] == want[1:]
            and local * min(got[0], want[0]) == max(got[0], want[0])
        ):
            raise ValueError(
                f"{fn}: {what} has shape {got} here, the gradient leaf needs {want}: "
                "the state was made outside shard_map (one residual for every device, "
                "which P(axis) splits) or passed without per-device specs. Fix: make it "
                "inside the map, specs = jaxsync.state_specs(jax.eval_shape(tx.init, "
                "params), axis_name); state = jax.jit(jax.shard_map(tx.init, mesh=mesh, "
                "in_specs=P(), out_specs=specs))(params), and pass it with specs."
            )
        raise ValueError(
            f"{fn}: {what} has shape {got}, the gradient leaf needs {want}: the state "
            "was made for another tree. Fix: call init with parameters of the same "
            "structure and shapes as the gradients."
        )


def _owned_residuals(state, owner: int) -> tuple:
    """The residuals, or zeros where ``state`` was made on another process (a
    checkpoint restored on the wrong rank): never another replica's error.
    One scalar compare and a select that fuses with the residual's use."""
    mine = state.owner == jnp.int32(owner)
    return tuple(jnp.where(mine, r, jnp.zeros((), r.dtype)) for r in state.residual)


def _owner_of(cfg) -> int:
    """This process's index as a state records it: the MPI rank, else 0."""
    return int(cfg.backend.comms.rank) if cfg.backend.name == "mpi" else 0


def _tree_error(fn, what, got, want):
    return ValueError(
        f"{fn}: the gradient tree has {got} {what}, the state was made for {want}. "
        "Fix: call init with parameters of the same structure and shapes as the "
        "gradients."
    )

"""Row-sparse gradients: indices + values (Caffe2's ``GradientSlice``).

An embedding table's gradient touches only the rows of the batch's ids. A
:class:`RowSparse` leaf holds those rows (``indices`` int32 ``(k,)``, ``values``
``(k, *row_shape)``) of a ``(num_rows, *row_shape)`` table. Every jaxsync
strategy accepts trees that mix dense leaves and ``RowSparse`` leaves: the dense
leaves go through the strategy's plan as before, the sparse ones are
*all-gathered* (never all-reduced): one all-gather per dtype over the local axes
and one across processes (MPI or ``AxisComm``), for all sparse leaves together.

Duplicated indices mean "add"; :meth:`RowSparse.todense` scatter-adds and drops
indices outside ``[0, num_rows)``.

This module holds the type and the options of its synchronisation
(:class:`SparseOptions`, the automatic sparse/dense choice). The rest lives in
``_sparse_sync`` (the all-gathers, hooked into ``_sync.sync``),
``_sparse_grad`` (:func:`row_sparse_grad`) and ``_sparse_optim`` (``densify``,
``sparse_sgd``, ``sparse_adagrad``, ``apply_sparse_updates``).

May import: numpy and JAX only (every other jaxsync module may import it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

_MODES = ("auto", "sparse", "dense")


# --------------------------------------------------------------------------
# The pytree.


@jax.tree_util.register_pytree_node_class
class RowSparse:
    """Rows of a ``(num_rows, *row_shape)`` gradient: ``indices`` and ``values``.

    Args:
      indices: integer array of shape ``(k,)``, stored as int32. Duplicates add
        up; an index outside ``[0, num_rows)`` is dropped by :meth:`todense`
        (and makes ``check_finite`` report a bad step).
      values: array of shape ``(k, *row_shape)``.
      num_rows: the table's number of rows (static: part of the tree structure).

    Attributes:
      indices: the int32 ``(k,)`` row indices.
      values: the ``(k, *row_shape)`` rows.
      num_rows: the table's number of rows.

    Example:
      >>> import jax.numpy as jnp, jaxsync
      >>> g = jaxsync.RowSparse(jnp.array([2, 0, 2]), jnp.ones((3, 2)), num_rows=4)
      >>> g.shape, g.k
      ((4, 2), 3)
      >>> g.todense()
      Array([[1., 1.],
             [0., 0.],
             [2., 2.],
             [0., 0.]], dtype=float32)
    """

    __slots__ = ("indices", "values", "num_rows")

    def __init__(self, indices: ArrayLike, values: ArrayLike, num_rows: int) -> None:
        if (
            isinstance(num_rows, bool)
            or not isinstance(num_rows, (int, np.integer))
            or num_rows < 1
        ):
            raise TypeError(
                "RowSparse got unexpected value for argument 'num_rows' (expected: a "
                f"Python int >= 1, got: {type(num_rows).__name__} {num_rows!r}). Fix: "
                "pass the table's number of rows, e.g. num_rows=table.shape[0]."
            )
        indices = jnp.asarray(indices)
        values = jnp.asarray(values)
        if indices.ndim != 1 or not jnp.issubdtype(indices.dtype, jnp.integer):
            raise TypeError(
                "RowSparse got unexpected value for argument 'indices' (expected: a "
                f"1-D integer array, got: {indices.dtype} of shape {indices.shape}). "
                "Fix: pass the row ids flattened, e.g. ids.reshape(-1)."
            )
        if values.ndim < 1 or values.shape[0] != indices.shape[0]:
            raise ValueError(
                f"RowSparse: values must have shape (k, *row_shape) with k = "
                f"len(indices) = {indices.shape[0]}, got {values.shape}. Fix: one row "
                "of values per index."
            )
        self.indices = indices.astype(jnp.int32)
        self.values = values
        self.num_rows = int(num_rows)

    # pytree protocol: num_rows is static aux data.
    def tree_flatten(self):
        return (self.indices, self.values), self.num_rows

    @classmethod
    def tree_unflatten(cls, num_rows, children):
        obj = object.__new__(cls)  # no checks: leaves may be tracers or sentinels
        obj.indices, obj.values = children
        obj.num_rows = num_rows
        return obj

    @property
    def k(self) -> int:
        """Number of rows held (with duplicates and padding)."""
        return int(self.indices.shape[-1])

    @property
    def row_shape(self) -> tuple:
        """Shape of one row: ``values.shape[1:]``."""
        return tuple(self.values.shape[1:])

    @property
    def shape(self) -> tuple:
        """Shape of the dense gradient: ``(num_rows, *row_shape)``."""
        return (self.num_rows, *self.row_shape)

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype of ``values``."""
        return self.values.dtype

    def valid(self) -> jax.Array:
        """Boolean ``(k,)``: which indices lie in ``[0, num_rows)``."""
        return (self.indices >= 0) & (self.indices < self.num_rows)

    def todense(self) -> jax.Array:
        """Scatter-add the rows into a ``(num_rows, *row_shape)`` array.

        Indices outside ``[0, num_rows)`` (for example the padding rows of
        :meth:`coalesce`, marked ``num_rows``) are dropped, never written.

        Returns:
          the dense gradient, of dtype ``values.dtype``.
        """
        idx = jnp.where(self.valid(), self.indices, self.num_rows)
        out = jnp.zeros(self.shape, self.values.dtype)
        return out.at[idx].add(self.values, mode="drop")

    def coalesce(self, size: int | None = None) -> RowSparse:
        """Sum duplicate indices: sorted unique rows, padded to a static size.

        Args:
          size: rows of the result (default ``min(k, num_rows)``, which always
            holds every unique valid index). Padding rows have index
            ``num_rows`` and zero values; invalid indices become padding.

        Returns:
          a ``RowSparse`` of ``size`` rows with the same :meth:`todense`.

        Example:
          >>> import jax.numpy as jnp, jaxsync
          >>> g = jaxsync.RowSparse(jnp.array([2, 0, 2]), jnp.ones((3, 1)), num_rows=4)
          >>> c = g.coalesce()
          >>> c.indices, c.values[:, 0]
          (Array([0, 2, 4], dtype=int32), Array([1., 2., 0.], dtype=float32))
        """
        return _coalesce(self, size)

    def __repr__(self) -> str:
        return (
            f"RowSparse(k={self.indices.shape}, row_shape={self.row_shape}, "
            f"num_rows={self.num_rows}, dtype={self.values.dtype})"
        )


def _is_rs(x) -> bool:
    return isinstance(x, RowSparse)


def _coalesce(g: RowSparse, size: int | None = None) -> RowSparse:
    n, v = g.k, g.num_rows
    size = min(n, v) if size is None else int(size)
    key = jnp.where(g.valid(), g.indices, v)
    order = jnp.argsort(key, stable=True)
    sk = key[order]
    new = jnp.concatenate([jnp.ones((1,), bool), sk[1:] != sk[:-1]]) if n else sk > 0
    seg = jnp.cumsum(new.astype(jnp.int32)) - 1  # segment of each sorted row
    idx = jnp.full((size,), v, jnp.int32).at[seg].set(sk, mode="drop")
    vals = jnp.zeros((size, *g.row_shape), g.values.dtype).at[seg].add(g.values[order], mode="drop")
    # The segment of invalid indices (key v, sorted last) holds their sum: zero it.
    keep = (idx < v).reshape((size,) + (1,) * len(g.row_shape))
    vals = jnp.where(keep, vals, jnp.zeros((), vals.dtype))
    return RowSparse.tree_unflatten(v, (idx, vals))


# --------------------------------------------------------------------------
# Options of the synchronisation.


@dataclasses.dataclass(frozen=True)
class SparseOptions:
    """How :class:`RowSparse` leaves are synchronised (``sparse=`` of every strategy).

    Args:
      mode: ``"auto"`` (default), ``"sparse"`` or ``"dense"``, or a dict from
        leaf path (``"emb"``, ``"params/Embed_0/embedding"``: keys joined by
        ``/``) to one of them; leaves not in the dict use ``"auto"``.
        ``"sparse"`` all-gathers indices and values (``R*k`` rows for ``R``
        replicas); ``"dense"`` scatters the rows into the dense table first and
        reduces it with the dense leaves (the result is then a dense array);
        ``"auto"`` picks sparse when ``R*k*(row_bytes + 4) < num_rows *
        row_bytes`` (fewer bytes on the wire), else dense.
      coalesce: sum duplicate indices of the gathered rows into
        ``min(R*k, num_rows)`` sorted unique rows (padding rows have index
        ``num_rows`` and zero values).
      densify: return the dense mean (a ``(num_rows, *row_shape)`` array)
        instead of a ``RowSparse``; the bytes on the wire stay sparse.

    Raises:
      TypeError, ValueError: at construction, naming the bad argument.

    Example:
      >>> import jax, jax.numpy as jnp, jaxsync
      >>> opts = jaxsync.SparseOptions(mode={"emb": "sparse"}, densify=True)
      >>> tx = jaxsync.hierarchical_mean(axis_name="i", comm=None, sparse=opts)
      >>> def step(idx, vals):   # one replica: its rows of a 4-row table
      ...     g = {"emb": jaxsync.RowSparse(idx, vals, num_rows=4)}
      ...     return tx.update(g, tx.init(g))[0]["emb"]
      >>> out = jax.vmap(step, axis_name="i")(jnp.array([[1], [3]]), jnp.ones((2, 1, 2)))
      >>> out[0]                 # the dense mean of both replicas' rows
      Array([[0. , 0. ],
             [0.5, 0.5],
             [0. , 0. ],
             [0.5, 0.5]], dtype=float32)
    """

    # A dict is stored as a sorted tuple of (path, mode) pairs (hashable).
    mode: str | Mapping[str, str] | tuple[tuple[str, str], ...] = "auto"
    coalesce: bool = False
    densify: bool = False

    def __post_init__(self):
        modes = self.mode.values() if isinstance(self.mode, Mapping) else [self.mode]
        if isinstance(self.mode, Mapping):
            bad = [k for k in self.mode if not isinstance(k, str)]
            if bad:
                raise TypeError(
                    f"SparseOptions got unexpected type for a key of argument 'mode' "
                    f"(expected: str leaf paths such as 'emb', got: {bad[0]!r}). Fix: "
                    "mode={'emb': 'sparse'}."
                )
            object.__setattr__(self, "mode", tuple(sorted(self.mode.items())))
        for m in modes:
            if not isinstance(m, str) or m not in _MODES:
                raise ValueError(
                    f"SparseOptions: mode must be one of {_MODES} or a dict of leaf "
                    f"paths to them, got {m!r}. Fix: mode='auto' (default), "
                    "mode='sparse', or mode={'emb': 'dense'}."
                )
        for name in ("coalesce", "densify"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"SparseOptions got unexpected type for argument {name!r} (expected: "
                    f"bool, got: {type(getattr(self, name)).__name__}). Fix: {name}=True."
                )

    def mode_of(self, path: str) -> str:
        """The mode of the leaf at ``path`` (keys joined by ``/``)."""
        if isinstance(self.mode, tuple):
            return dict(self.mode).get(path, "auto")
        return str(self.mode)


def check_options(fn: str, sparse: Any) -> SparseOptions:
    """Validate the ``sparse=`` option of a factory."""
    if sparse is None:
        return SparseOptions()
    if not isinstance(sparse, SparseOptions):
        raise TypeError(
            f"{fn} got unexpected type for argument 'sparse' (expected: "
            f"jaxsync.SparseOptions or None, got: {type(sparse).__name__} {sparse!r}). "
            "Fix: sparse=jaxsync.SparseOptions(mode='auto', coalesce=False)."
        )
    return sparse


def path_str(path) -> str:
    """A key path as ``a/b/0``: how ``SparseOptions.mode`` and ``tables`` name leaves."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def choose(mode: str, replicas: int, g: RowSparse) -> str:
    """The automatic choice: sparse when it puts fewer bytes on the wire.

    Integer rows are always gathered: the dense path passes integer leaves
    through unreduced, which would return this replica's own rows.
    """
    if not jnp.issubdtype(g.dtype, jnp.floating):
        return "sparse"
    if mode != "auto":
        return mode
    row_bytes = int(np.prod(g.row_shape, dtype=np.int64)) * jnp.dtype(g.dtype).itemsize
    sparse_bytes = replicas * g.k * (row_bytes + 4)
    return "sparse" if sparse_bytes < g.num_rows * row_bytes else "dense"


def has_row_sparse(tree: Any) -> bool:
    """Whether ``tree`` holds a :class:`RowSparse` leaf (then ``_sync.sync``
    hands it to ``_sparse_sync.sync_mixed``)."""
    return any(_is_rs(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=_is_rs))

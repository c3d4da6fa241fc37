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
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

import jax
import jax.numpy as jnp
import optax
from jax import lax

from . import _intra, _invariance, _mpi_backend

PyTree = Any
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

    def __init__(self, indices, values, num_rows: int):
        if isinstance(num_rows, bool) or not isinstance(num_rows, (int, np.integer)) \
                or num_rows < 1:
            raise TypeError(
                "RowSparse got unexpected value for argument 'num_rows' (expected: a "
                f"Python int >= 1, got: {type(num_rows).__name__} {num_rows!r}). Fix: "
                "pass the table's number of rows, e.g. num_rows=table.shape[0].")
        indices = jnp.asarray(indices)
        values = jnp.asarray(values)
        if indices.ndim != 1 or not jnp.issubdtype(indices.dtype, jnp.integer):
            raise TypeError(
                "RowSparse got unexpected value for argument 'indices' (expected: a "
                f"1-D integer array, got: {indices.dtype} of shape {indices.shape}). "
                "Fix: pass the row ids flattened, e.g. ids.reshape(-1).")
        if values.ndim < 1 or values.shape[0] != indices.shape[0]:
            raise ValueError(
                f"RowSparse: values must have shape (k, *row_shape) with k = "
                f"len(indices) = {indices.shape[0]}, got {values.shape}. Fix: one row "
                "of values per index.")
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
        return tuple(self.values.shape[1:])

    @property
    def shape(self) -> tuple:
        """Shape of the dense gradient: ``(num_rows, *row_shape)``."""
        return (self.num_rows, *self.row_shape)

    @property
    def dtype(self):
        return self.values.dtype

    def valid(self):
        """Boolean ``(k,)``: which indices lie in ``[0, num_rows)``."""
        return (self.indices >= 0) & (self.indices < self.num_rows)

    def todense(self):
        """Scatter-add the rows into a ``(num_rows, *row_shape)`` array.

        Indices outside ``[0, num_rows)`` (for example the padding rows of
        :meth:`coalesce`, marked ``num_rows``) are dropped, never written.
        """
        idx = jnp.where(self.valid(), self.indices, self.num_rows)
        out = jnp.zeros(self.shape, self.values.dtype)
        return out.at[idx].add(self.values, mode="drop")

    def coalesce(self, size: int | None = None) -> "RowSparse":
        """Sum duplicate indices: sorted unique rows, padded to a static size.

        Args:
          size: rows of the result (default ``min(k, num_rows)``, which always
            holds every unique valid index). Padding rows have index
            ``num_rows`` and zero values; invalid indices become padding.
        """
        return _coalesce(self, size)

    def __repr__(self):
        return (f"RowSparse(k={self.indices.shape}, row_shape={self.row_shape}, "
                f"num_rows={self.num_rows}, dtype={self.values.dtype})")


def _is_rs(x) -> bool:
    return isinstance(x, RowSparse)


def _coalesce(g: RowSparse, size=None) -> RowSparse:
    n, v = g.k, g.num_rows
    size = min(n, v) if size is None else int(size)
    key = jnp.where(g.valid(), g.indices, v)
    order = jnp.argsort(key, stable=True)
    sk = key[order]
    new = jnp.concatenate([jnp.ones((1,), bool), sk[1:] != sk[:-1]]) if n else sk > 0
    seg = jnp.cumsum(new.astype(jnp.int32)) - 1     # segment of each sorted row
    idx = jnp.full((size,), v, jnp.int32).at[seg].set(sk, mode="drop")
    vals = jnp.zeros((size, *g.row_shape), g.values.dtype).at[seg].add(
        g.values[order], mode="drop")
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

    Example:
      >>> import jaxsync
      >>> tx = jaxsync.hierarchical_mean(
      ...     axis_name="i", comm=None,
      ...     sparse=jaxsync.SparseOptions(mode={"emb": "sparse"}, coalesce=True))
    """

    mode: Any = "auto"
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
                    "mode={'emb': 'sparse'}.")
            object.__setattr__(self, "mode", tuple(sorted(self.mode.items())))
        for m in modes:
            if not isinstance(m, str) or m not in _MODES:
                raise ValueError(
                    f"SparseOptions: mode must be one of {_MODES} or a dict of leaf "
                    f"paths to them, got {m!r}. Fix: mode='auto' (default), "
                    "mode='sparse', or mode={'emb': 'dense'}.")
        for name in ("coalesce", "densify"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"SparseOptions got unexpected type for argument {name!r} (expected: "
                    f"bool, got: {type(getattr(self, name)).__name__}). Fix: {name}=True.")

    def mode_of(self, path: str) -> str:
        if isinstance(self.mode, tuple):
            return dict(self.mode).get(path, "auto")
        return self.mode


def check_options(fn: str, sparse) -> SparseOptions:
    """Validate the ``sparse=`` option of a factory."""
    if sparse is None:
        return SparseOptions()
    if not isinstance(sparse, SparseOptions):
        raise TypeError(
            f"{fn} got unexpected type for argument 'sparse' (expected: "
            f"jaxsync.SparseOptions or None, got: {type(sparse).__name__} {sparse!r}). "
            "Fix: sparse=jaxsync.SparseOptions(mode='auto', coalesce=False).")
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
    """The automatic choice: sparse when it puts fewer bytes on the wire."""
    if mode != "auto":
        return mode
    row_bytes = int(np.prod(g.row_shape, dtype=np.int64)) * jnp.dtype(g.dtype).itemsize
    sparse_bytes = replicas * g.k * (row_bytes + 4)
    return "sparse" if sparse_bytes < g.num_rows * row_bytes else "dense"


def wire_bytes(mode: str, replicas: int, g: RowSparse) -> int:
    """Bytes one replica contributes to the wire for ``g`` (gathered or reduced)."""
    row_bytes = int(np.prod(g.row_shape, dtype=np.int64)) * jnp.dtype(g.dtype).itemsize
    if mode == "sparse":
        return g.k * (row_bytes + 4)
    return g.num_rows * row_bytes


# --------------------------------------------------------------------------
# The synchronisation: a hook of ``_sync.sync``.


@jax.tree_util.register_pytree_node_class
class _Hole:
    """Where a sparse leaf was: an empty pytree node for the dense plan."""

    def tree_flatten(self):
        return (), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls()


def has_row_sparse(tree) -> bool:
    return any(_is_rs(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=_is_rs))


def sync_mixed(tree, cfg, dense_sync: Callable):
    """Sync dense leaves with ``dense_sync(tree, cfg)`` and RowSparse leaves by gathers."""
    opts = cfg.sparse if cfg.sparse is not None else SparseOptions()
    _intra.check_axes(cfg.axes)
    intra = _intra.AxisOps(cfg.axes)
    replicas = intra.size * cfg.backend.size()
    if cfg.axes and intra.size == 1 and getattr(cfg.backend, "native", False):
        # As the dense path: no local stage; results typed invariant over the
        # size-1 local axes by the MPI call itself.
        intra = _intra.AxisOps((), unit_axes=cfg.axes)
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_rs)
    sparse_at = [i for i, (_, x) in enumerate(with_paths) if _is_rs(x)]
    paths = {i: path_str(with_paths[i][0]) for i in sparse_at}
    modes = {i: choose(opts.mode_of(paths[i]), replicas, with_paths[i][1])
             for i in sparse_at}
    # Agreement first: k, num_rows, shapes, dtypes and the chosen side of every
    # sparse leaf; a mismatch fails every process with the same message.
    lines = [f"row-sparse leaf {paths[i]}: k {g.k} num_rows {g.num_rows} row_shape "
             f"{g.row_shape} values {g.dtype} indices {g.indices.dtype} -> {modes[i]}"
             for i in sparse_at for g in [with_paths[i][1]]]
    lines.append(f"sparse options mode {opts.mode} coalesce {opts.coalesce} densify "
                 f"{opts.densify} reduce {cfg.reduce} replicas per process "
                 f"{intra.size if intra.axes else 1} backend {cfg.backend.name}")
    flat = [x for i in sparse_at for x in (with_paths[i][1].indices,
                                           with_paths[i][1].values)]
    flat = cfg.backend.agree("\n".join(lines), "gradient tree", flat)
    leaves = [x for _, x in with_paths]
    for j, i in enumerate(sparse_at):
        leaves[i] = RowSparse.tree_unflatten(leaves[i].num_rows, flat[2 * j: 2 * j + 2])
    dense_leaves = list(leaves)
    for i in sparse_at:
        dense_leaves[i] = _Hole()
        if modes[i] == "dense":
            dense_leaves[i] = leaves[i].todense()
            if cfg.check_finite and jnp.issubdtype(leaves[i].dtype, jnp.floating):
                # An index out of range on any replica makes one element NaN, so
                # the reduced leaf (the same on every replica) fails the check.
                bad = jnp.where(jnp.all(leaves[i].valid()), 0.0, jnp.nan)
                d = dense_leaves[i]
                dense_leaves[i] = d.at[(0,) * d.ndim].add(bad.astype(d.dtype))
    dense_out, finite = dense_sync(treedef.unflatten(dense_leaves), cfg)
    out = treedef.flatten_up_to(dense_out)
    sparse = [i for i in sparse_at if modes[i] == "sparse"]
    synced, ok = _sync_sparse([leaves[i] for i in sparse], cfg, intra, replicas, opts)
    for i, g in zip(sparse, synced):
        out[i] = g
    if cfg.check_finite and finite is not None and ok is not None:
        finite = finite & ok
        if cfg.check_finite == "raise":
            _raise_if_bad([paths[i] for i in sparse], ok)
    return treedef.unflatten(out), finite


def _sync_sparse(gs: list, cfg, intra, replicas: int, opts: SparseOptions):
    """All-gather every RowSparse of ``gs``: one call per dtype per stage."""
    if not gs:
        return [], None
    axes = cfg.axes + cfg.backend.mesh_axes
    gs = [_share(g, axes) for g in gs]
    mean = cfg.reduce == "mean"
    scale = mean and not opts.densify
    # One buffer of int32 indices, one buffer of values per dtype.
    bufs = [_concat([g.indices for g in gs])]
    groups: dict = {}
    for j, g in enumerate(gs):
        groups.setdefault(str(g.dtype), []).append(j)
    for dt, js in groups.items():
        bufs.append(_concat([_prescale(gs[j].values, replicas if scale else 1)
                             .reshape(-1) for j in js]))
    # (L*m,): the inter stage takes 1-D buffers (host staging ties them by
    # their first element); a reshape of a contiguous array is free.
    got = [intra.allgather(b).reshape(-1) for b in bufs]
    if isinstance(cfg.backend, _mpi_backend.MPIBackend) and not cfg.backend.native:
        # Host staging and mpi4jax choose the leader with lax.cond, whose branches
        # must keep shapes: the input is padded to the gathered size.
        procs, sizes = cfg.backend.size(), [b.shape[0] for b in got]
        got = [jnp.pad(b, (0, (procs - 1) * b.shape[0])) for b in got]
        got = cfg.backend.run(
            lambda ops, bs: [ops.allgather(b[:m]).reshape(-1) for b, m in zip(bs, sizes)],
            got, intra, leader_only=True)
    else:
        got = cfg.backend.run(_gather_program, got, intra, leader_only=True)  # (P, L*m)
    got = [x.reshape(replicas, -1) for x in got]                  # (R, m) rank-major
    out: list = [None] * len(gs)
    idx_all, off = got[0], 0
    indices = []
    for g in gs:
        indices.append(idx_all[:, off: off + g.k].reshape(-1))
        off += g.k
    oks = []
    for (dt, js), vals in zip(groups.items(), got[1:]):
        off = 0
        for j in js:
            g = gs[j]
            w = g.k * int(np.prod(g.row_shape, dtype=np.int64))
            v = vals[:, off: off + w].reshape(replicas * g.k, *g.row_shape)
            off += w
            full = RowSparse.tree_unflatten(g.num_rows, (indices[j], v))
            if cfg.check_finite:
                oks.append(jnp.all(full.valid()) & jnp.all(jnp.isfinite(v)))
            if opts.densify:
                d = full.todense()
                out[j] = _postscale(d, replicas) if mean else d
            elif opts.coalesce:
                out[j] = _coalesce(full)
            else:
                out[j] = full
    ok = jnp.all(jnp.stack(oks)) if oks else None
    return out, ok


def _gather_program(ops, bufs):
    return [ops.allgather(b) for b in bufs]


def _concat(xs):
    return xs[0] if len(xs) == 1 else jnp.concatenate(xs)


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _prescale(v, n: int):
    if n == 1 or not jnp.issubdtype(v.dtype, jnp.floating):
        return v
    if _is_pow2(n):
        return v * jnp.asarray(1.0 / n, v.dtype)   # exact
    return v / jnp.asarray(n, v.dtype)


def _postscale(d, n: int):
    if n == 1:
        return d
    wide = jnp.float32 if str(d.dtype) in ("float16", "bfloat16") else d.dtype
    return (d.astype(wide) / jnp.asarray(n, wide)).astype(d.dtype)


def _share(g: RowSparse, axes):
    """As ``share_invariant``: a gradient autodiff already summed counts once."""
    if not axes:
        return g
    typed = set(_invariance._vma(lax.axis_index(axes)))
    if not typed:  # vmap, pmap or check_vma=False: no axis types
        return g
    values = _invariance.share_invariant(g.values, axes)
    values = _invariance._varying(values, tuple(a for a in axes if a in typed))
    indices = _invariance._varying(g.indices, tuple(a for a in axes if a in typed))
    return RowSparse.tree_unflatten(g.num_rows, (indices, values))


def _raise_if_bad(names, ok):
    def check(ok):
        if not bool(ok):
            raise FloatingPointError(
                "jaxsync: non-finite values, or indices outside [0, num_rows), in the "
                f"row-sparse leaves {', '.join(names[:10])} after synchronisation. "
                "Every replica sees the same rows. Use check_finite=True and "
                "optax.apply_if_finite to skip such steps instead of failing.")

    jax.debug.callback(check, ok)


# --------------------------------------------------------------------------
# Getting a RowSparse gradient from a model.


def _lookup(tree, path: str, what: str):
    for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if path_str(p) == path:
            return leaf
    names = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    raise KeyError(f"row_sparse_grad: no leaf {path!r} in {what}; its leaves are "
                   f"{names[:20]}{' ...' if len(names) > 20 else ''}. Fix: name the leaf "
                   "by its keys joined with '/', e.g. 'params/Embed_0/embedding'.")


def _replace(tree, repl: Mapping[str, Any]):
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return treedef.unflatten([repl.get(path_str(p), x) for p, x in with_paths])


def _unique(ids, num_rows: int):
    """Sorted unique ids padded with ``num_rows`` to ``min(ids.size, num_rows)``
    and, for each id, its position in them."""
    flat = ids.reshape(-1).astype(jnp.int32)
    size = min(flat.shape[0], num_rows)
    key = jnp.where((flat >= 0) & (flat < num_rows), flat, num_rows)
    order = jnp.argsort(key, stable=True)
    sk = key[order]
    new = jnp.concatenate([jnp.ones((1,), bool), sk[1:] != sk[:-1]])
    seg = jnp.cumsum(new.astype(jnp.int32)) - 1
    uniq = jnp.full((size,), num_rows, jnp.int32).at[seg].set(sk, mode="drop")
    pos = jnp.zeros_like(seg).at[order].set(seg)
    return uniq, pos.reshape(ids.shape)


def row_sparse_grad(loss_fn: Callable, params: PyTree, batch: PyTree, *,
                    tables: Mapping[str, Any], has_aux: bool = False,
                    return_value: bool = False):
    """Gradient of ``loss_fn(params, batch)`` with ``RowSparse`` leaves for tables.

    ``jax.grad`` of an embedding table is a dense ``(num_rows, ...)`` array. For
    each table named in ``tables``, this returns a :class:`RowSparse` holding
    only the rows the batch uses (sorted unique ids, padded with index
    ``num_rows`` to ``min(ids.size, num_rows)`` rows); other leaves are dense as
    with ``jax.grad``.

    Args:
      loss_fn: ``loss_fn(params, batch)`` returning a scalar (or ``(scalar,
        aux)`` with ``has_aux``).
      params: the parameter pytree.
      batch: the batch pytree.
      tables: maps a table's path in ``params`` (keys joined by ``/``) to where
        its ids are. A **string** is the path of the ids in ``batch``: the model
        then runs on a compact table of the used rows, with the ids replaced by
        positions in it, so no dense ``(num_rows, ...)`` gradient is ever formed
        (the model must index the table only with those ids and must not check
        its shape: flax's ``nn.Embed`` does; use an array there). An **array**
        of ids: the dense gradient is computed as usual and its rows at those
        ids are gathered (works with any model; rows the model reads that are
        not in the ids are lost).
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      return_value: also return the loss, like ``jax.value_and_grad``.

    Returns:
      ``grads``; ``(grads, aux)`` with ``has_aux``; ``(value, grads)`` with
      ``return_value`` (``((loss, aux), grads)`` with both).

    Example:
      >>> import jax.numpy as jnp, jaxsync
      >>> params = {"emb": jnp.arange(12.0).reshape(6, 2), "w": jnp.ones(2)}
      >>> batch = {"ids": jnp.array([[4, 1], [4, 4]])}
      >>> def loss_fn(p, b):
      ...     return jnp.sum(p["emb"][b["ids"]] @ p["w"])
      >>> g = jaxsync.row_sparse_grad(loss_fn, params, batch, tables={"emb": "ids"})
      >>> g["emb"].indices, g["emb"].values[:, 0]
      (Array([1, 4, 6, 6], dtype=int32), Array([1., 3., 0., 0.], dtype=float32))
      >>> bool((g["emb"].todense() == jax.grad(loss_fn)(params, batch)["emb"]).all())
      True
    """
    if not isinstance(tables, Mapping) or not tables:
        raise TypeError(
            "row_sparse_grad got unexpected value for argument 'tables' (expected: a "
            f"non-empty dict of table path -> ids path or ids array, got: {tables!r}). "
            "Fix: tables={'emb': 'ids'}.")
    p_repl, b_repl, info = {}, {}, {}
    for tpath, where in tables.items():
        table = _lookup(params, tpath, "params")
        ids = _lookup(batch, where, "batch") if isinstance(where, str) else jnp.asarray(where)
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"row_sparse_grad: the ids of table {tpath!r} must be "
                            f"integers, got {ids.dtype}.")
        num_rows = table.shape[0]
        uniq, pos = _unique(ids, num_rows)
        info[tpath] = (uniq, num_rows, isinstance(where, str))
        if isinstance(where, str):
            p_repl[tpath] = table.at[uniq].get(mode="fill", fill_value=0)
            b_repl[where] = pos
    params2, batch2 = _replace(params, p_repl), _replace(batch, b_repl)
    vg = jax.value_and_grad(loss_fn, has_aux=has_aux)
    value, grads = vg(params2, batch2)
    g_paths, g_def = jax.tree_util.tree_flatten_with_path(grads)
    leaves = []
    for p, g in g_paths:
        name = path_str(p)
        if name in info:
            uniq, num_rows, compact = info[name]
            rows = g if compact else g.at[uniq].get(mode="fill", fill_value=0)
            leaves.append(RowSparse.tree_unflatten(num_rows, (uniq, rows)))
        else:
            leaves.append(g)
    grads = g_def.unflatten(leaves)
    if return_value:
        return value, grads
    if has_aux:
        return grads, value[1]
    return grads


# --------------------------------------------------------------------------
# Applying: densify, sparse_sgd, sparse_adagrad.


def _dense(x):
    return x.todense() if _is_rs(x) else x


def densify() -> optax.GradientTransformation:
    """Turn ``RowSparse`` leaves into dense arrays (other leaves pass through).

    Put it between a jaxsync strategy and a dense optimizer:
    ``optax.chain(jaxsync.hierarchical_mean(...), jaxsync.densify(), optax.adam(...))``.

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
            f"{learning_rate!r}). Fix: learning_rate=0.1.")
    if not learning_rate > 0:
        raise ValueError(f"{fn}: learning_rate must be > 0, got {learning_rate}. "
                         "Fix: learning_rate=0.1.")


class ScheduleState(NamedTuple):
    """Step count of a sparse optimizer (for a learning-rate schedule)."""

    count: jax.Array


def _lr(learning_rate, count):
    return learning_rate(count) if callable(learning_rate) else learning_rate


def sparse_sgd(learning_rate) -> optax.GradientTransformation:
    """SGD that keeps ``RowSparse`` updates sparse: only touched rows change.

    Dense leaves get ``-learning_rate * g``; ``RowSparse`` leaves get a
    ``RowSparse`` of ``-learning_rate * values``. Apply the updates with
    :func:`jaxsync.apply_sparse_updates` (a scatter-add of the ``k`` rows).

    Args:
      learning_rate: a float > 0 or an optax schedule.

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

        return (jax.tree.map(one, updates, is_leaf=_is_rs),
                ScheduleState(count=state.count + 1))

    return optax.GradientTransformation(init_fn, update_fn)


class SparseAdagradState(NamedTuple):
    """Sum of squared gradients (dense, like the parameters) and the step count."""

    sum_of_squares: PyTree
    count: jax.Array


def sparse_adagrad(learning_rate, initial_accumulator_value: float = 0.1,
                   eps: float = 1e-7) -> optax.GradientTransformation:
    """Adagrad that reads and writes only the touched rows (Caffe2's SparseAdagrad).

    The accumulator of a ``RowSparse`` leaf is dense like its table, but each
    step sums duplicate indices first, then updates only those rows of the
    accumulator and returns a ``RowSparse`` update (apply it with
    :func:`jaxsync.apply_sparse_updates`). Every leaf, dense or sparse, is
    updated by Caffe2's rule ``-learning_rate * g / (sqrt(acc) + eps)``
    (``optax.adagrad`` puts ``eps`` inside the root instead).

    Args:
      learning_rate: a float > 0 or an optax schedule.
      initial_accumulator_value: starting value of the accumulators (>= 0).
      eps: added to the square root of the accumulator (> 0).

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
    for name, val, lo in (("initial_accumulator_value", initial_accumulator_value, 0.0),
                          ("eps", eps, 0.0)):
        if isinstance(val, bool) or not isinstance(val, (int, float)) or not val >= lo:
            raise ValueError(f"sparse_adagrad: {name} must be a float >= {lo}, got "
                             f"{val!r}. Fix: {name}=0.1.")

    def init_fn(params):
        acc = jax.tree.map(lambda p: jnp.full(p.shape, initial_accumulator_value, p.dtype),
                           params)
        return SparseAdagradState(sum_of_squares=acc, count=jnp.zeros((), jnp.int32))

    def update_fn(updates, state, params=None):
        del params
        lr = _lr(learning_rate, state.count)

        def one(g, acc):
            if _is_rs(g):
                c = _coalesce(g, size=min(g.k, g.num_rows))
                rows = acc.at[c.indices].get(mode="fill", fill_value=0) + c.values ** 2
                acc = acc.at[c.indices].set(rows, mode="drop")
                upd = -lr * c.values / (jnp.sqrt(rows) + eps)
                return RowSparse.tree_unflatten(g.num_rows, (c.indices,
                                                             upd.astype(g.dtype))), acc
            acc = acc + g * g
            return (-lr * g / (jnp.sqrt(acc) + eps)).astype(g.dtype), acc

        flat_g, gdef = jax.tree_util.tree_flatten(updates, is_leaf=_is_rs)
        flat_a = gdef.flatten_up_to(state.sum_of_squares)
        pairs = [one(g, a) for g, a in zip(flat_g, flat_a)]
        return (gdef.unflatten([p[0] for p in pairs]),
                SparseAdagradState(gdef.unflatten([p[1] for p in pairs]),
                                   state.count + 1))

    return optax.GradientTransformation(init_fn, update_fn)


def apply_sparse_updates(params: PyTree, updates: PyTree) -> PyTree:
    """``optax.apply_updates`` that scatter-adds ``RowSparse`` updates.

    Only the ``k`` rows of a sparse update are read and written (in place when
    the step donates ``params``); indices outside ``[0, num_rows)`` are dropped.

    Example:
      >>> import jax.numpy as jnp, jaxsync
      >>> upd = {"emb": jaxsync.RowSparse(jnp.array([0, 0]), jnp.ones((2, 1)), 2)}
      >>> jaxsync.apply_sparse_updates({"emb": jnp.zeros((2, 1))}, upd)["emb"][:, 0]
      Array([2., 0.], dtype=float32)
    """
    flat_u, udef = jax.tree_util.tree_flatten(updates, is_leaf=_is_rs)
    flat_p = udef.flatten_up_to(params)

    def one(p, u):
        if u is None:
            return p
        if _is_rs(u):
            idx = jnp.where(u.valid(), u.indices, u.num_rows)
            return p.at[idx].add(u.values.astype(p.dtype), mode="drop")
        return (jnp.asarray(p) + u).astype(jnp.asarray(p).dtype)

    return udef.unflatten([one(p, u) for p, u in zip(flat_p, flat_u)])

"""Getting a :class:`RowSparse` gradient from a model: :func:`row_sparse_grad`.

May import: ``_sparse`` (the type, ``path_str``); JAX. Nothing that synchronises.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from ._rows import RowSparse, path_str

PyTree = Any


def _lookup(tree, path: str, what: str):
    for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if path_str(p) == path:
            return leaf
    names = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    raise KeyError(
        f"row_sparse_grad: no leaf {path!r} in {what}; its leaves are "
        f"{names[:20]}{' ...' if len(names) > 20 else ''}. Fix: name the leaf "
        "by its keys joined with '/', e.g. 'params/Embed_0/embedding'."
    )


def _replace(tree, repl: Mapping[str, Any]):
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return jax.tree_util.tree_unflatten(treedef, [repl.get(path_str(p), x) for p, x in with_paths])


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


def row_sparse_grad(
    loss_fn: Callable,
    params: PyTree,
    batch: PyTree,
    *,
    tables: Mapping[str, Any],
    has_aux: bool = False,
    return_value: bool = False,
) -> Any:
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

    Raises:
      TypeError: ``tables`` is not a non-empty dict, or ids are not integers.
      KeyError: a table or ids path names no leaf.

    Example:
      >>> import jax, jax.numpy as jnp, jaxsync
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
            "Fix: tables={'emb': 'ids'}."
        )
    p_repl, b_repl, info = {}, {}, {}
    for tpath, where in tables.items():
        table = _lookup(params, tpath, "params")
        ids = _lookup(batch, where, "batch") if isinstance(where, str) else jnp.asarray(where)
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(
                f"row_sparse_grad: the ids of table {tpath!r} must be integers, got {ids.dtype}."
            )
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
    grads = jax.tree_util.tree_unflatten(g_def, leaves)
    if return_value:
        return value, grads
    if has_aux:
        return grads, value[1]
    return grads

"""Where each replica's slice of every leaf lives: the sharded layout.

With ``N`` replicas (``D`` devices per process x ``P`` processes), leaf ``i``
of ``n_i`` elements is cut into ``N`` slices of ``k_i = ceil(n_i / N)``
elements (the last padded with zeros). Replica ``s = p * D + d`` (process
``p``, local device ``d``) owns slice ``s`` of every leaf, so a process's
devices own consecutive slices, and the processes' saved states concatenate in
slice order. A slice keeps its leaf's rank, ``(1, ..., 1, k)`` (a scalar's is
``(k,)``), so rules that read ``ndim`` see the leaf's.

One buffer per dtype holds the leaves' slices side by side, ``(N, K)`` with
``K = sum k_i``, its rows ordered for a reduce-scatter over the devices first
and then over the processes: row ``d * P + p`` is slice ``p * D + d``. After
both scatters a replica holds its ``K`` elements; after the two all-gathers
of the updates every replica holds every row again.

Imports: jax only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclasses.dataclass(frozen=True)
class Slot:
    """One leaf: its path, shape, dtype, size, and its slice length ``k``."""

    path: str
    shape: tuple
    dtype: str
    n: int
    k: int

    @property
    def slice_shape(self) -> tuple:
        return slice_shape(self.shape, self.k)


def slice_shape(shape: tuple, k: int) -> tuple:
    """A slice of ``k`` elements of a leaf of ``shape``: the leaf's rank kept."""
    return (1,) * (len(shape) - 1) + (k,) if len(shape) else (k,)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The sharded layout of one tree over ``devices x processes`` replicas."""

    slots: tuple
    treedef: Any
    devices: int
    processes: int

    @property
    def replicas(self) -> int:
        return self.devices * self.processes

    def tree(self, leaves: list):
        """``leaves`` (tree order) in the tree's structure."""
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def groups(self) -> dict:
        """dtype -> the indices of its leaves, in tree order."""
        out: dict = {}
        for i, s in enumerate(self.slots):
            out.setdefault(s.dtype, []).append(i)
        return out

    def describe(self) -> str:
        leaves = "; ".join(f"{s.path} {s.shape} {s.dtype}" for s in self.slots)
        return f"sharded over {self.devices} x {self.processes} replicas: {leaves}"

    # -- the gradients: every replica's full tree -> (N * K,) buffers --------
    def pack_rows(self, leaves: list) -> list:
        """One buffer per dtype, rows in the scatters' order (see the module)."""
        n = self.replicas
        bufs = []
        for idx in self.groups().values():
            cols = [_rows(leaves[i], self.slots[i], n) for i in idx]
            cols = [c for c in cols if c.shape[1]]
            if not cols:
                bufs.append(jnp.zeros((0,), leaves[idx[0]].dtype))
                continue
            rows = cols[0] if len(cols) == 1 else jnp.concatenate(cols, axis=1)
            bufs.append(self._to_positions(rows).reshape(-1))
        return bufs

    def leaf_rows(self, leaves: list) -> list:
        """Each leaf flattened and padded to ``N * k`` (one device per process:
        its rows are in slice order already, nothing to pack)."""
        return [_rows(x, s, self.replicas).reshape(-1) for x, s in zip(leaves, self.slots)]

    def split_leaves(self, pieces: list, finish=None) -> list:
        """Each leaf's ``(k,)`` slice -> its slice shape (``finish`` first)."""
        out = []
        for i, (piece, s) in enumerate(zip(pieces, self.slots)):
            piece = piece if s.k else jnp.zeros((0,), piece.dtype)
            piece = finish(i, piece) if finish is not None else piece
            out.append(piece.reshape(s.slice_shape))
        return out

    def _to_positions(self, rows):
        """Rows in slice order (``p * D + d``) -> in buffer order (``d * P + p``)."""
        return _swap_rows(rows, self.processes, self.devices)

    def _from_positions(self, rows):
        """Rows in buffer order (``d * P + p``) -> in slice order (``p * D + d``)."""
        return _swap_rows(rows, self.devices, self.processes)

    # -- one replica's slices <-> its (K,) buffers ---------------------------
    def split(self, bufs: list, finish=None) -> list:
        """A replica's ``(K,)`` buffers -> its slice of every leaf (tree order)."""
        out: list = [None] * len(self.slots)
        for buf, idx in zip(bufs, self.groups().values()):
            a = 0
            for i in idx:
                s = self.slots[i]
                piece = lax.slice(buf, (a,), (a + s.k,)) if s.k else jnp.zeros((0,), buf.dtype)
                a += s.k
                piece = finish(i, piece) if finish is not None else piece
                out[i] = piece.reshape(s.slice_shape)
        return out

    def join(self, slices: list) -> list:
        """A replica's slices (tree order) -> one ``(K,)`` buffer per dtype."""
        bufs = []
        for idx in self.groups().values():
            parts = [slices[i].reshape(-1) for i in idx]
            bufs.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts))
        return bufs

    # -- every replica's updates: (N * K,) buffers -> full leaves ------------
    def unpack_rows(self, bufs: list) -> list:
        n = self.replicas
        out: list = [None] * len(self.slots)
        for buf, idx in zip(bufs, self.groups().values()):
            total = sum(self.slots[i].k for i in idx)
            rows = self._from_positions(buf.reshape(n, total)) if total else None
            a = 0
            for i in idx:
                s = self.slots[i]
                if s.k:
                    assert rows is not None
                    cols = lax.slice(rows, (0, a), (n, a + s.k))
                    out[i] = cols.reshape(-1)[: s.n].reshape(s.shape)
                else:
                    out[i] = jnp.zeros(s.shape, buf.dtype)
                a += s.k
        return out

    def unleaf_rows(self, bufs: list) -> list:
        """Each leaf's gathered ``(N * k,)`` slices -> the leaf (one device per
        process: the inverse of ``leaf_rows``)."""
        return [
            b.reshape(-1)[: s.n].reshape(s.shape) if s.k else jnp.zeros(s.shape, b.dtype)
            for b, s in zip(bufs, self.slots)
        ]

    # -- one replica's slice of a full tree (the parameters) -----------------
    def take(self, leaves: list, index) -> list:
        """Slice ``index`` (traced or static) of every leaf."""
        n = self.replicas
        out = []
        for x, s in zip(leaves, self.slots):
            rows = _rows(x, s, n)
            piece = lax.dynamic_index_in_dim(rows, index, 0, keepdims=False)
            out.append(piece.reshape(s.slice_shape))
        return out

    def slice_structs(self, extra: int = 0) -> list:
        """``ShapeDtypeStruct``s of one replica's slices (``k + extra`` each)."""
        return [
            jax.ShapeDtypeStruct(slice_shape(s.shape, s.k + extra), jnp.dtype(s.dtype))
            for s in self.slots
        ]


def _swap_rows(rows, a: int, b: int):
    """``(a * b, k)`` rows, row ``i * b + j`` moved to row ``j * a + i``."""
    if a == 1 or b == 1:
        return rows
    k = rows.shape[1]
    return rows.reshape(a, b, k).transpose(1, 0, 2).reshape(a * b, k)


def _rows(x, s: Slot, n: int):
    """``x`` flattened, padded to ``n * k`` and viewed as ``(n, k)``."""
    flat = x.reshape(-1)
    if n * s.k != s.n:
        flat = jnp.pad(flat, (0, n * s.k - s.n))
    return flat.reshape(n, s.k)


def make_layout(tree, devices: int, processes: int, fn: str = "sharded") -> Layout:
    """The layout of ``tree``'s leaves (arrays or structs) over the replicas."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    n = devices * processes
    slots = []
    for path, x in flat:
        name = jax.tree_util.keystr(path)
        dtype = getattr(x, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"{fn}: the gradient leaf {name} is {_what(x)}, not a floating-point "
                "array; sharded reduces and updates floating-point leaves only. Fix: "
                "pass the gradients of the arrays only (e.g. eqx.filter(grads, "
                "eqx.is_inexact_array)), or keep the other leaves out of the tree."
            )
        size = int(np.prod(x.shape))
        slots.append(Slot(name, tuple(x.shape), str(jnp.dtype(dtype)), size, -(-size // n)))
    return Layout(tuple(slots), treedef, devices, processes)


def _what(x) -> str:
    dtype = getattr(x, "dtype", None)
    return f"of dtype {dtype}" if dtype is not None else f"a {type(x).__name__}"

"""Sparse gradients: embedding tables whose gradients touch a few rows.

``RowSparse`` holds the rows a step touched (``row_sparse_grad`` makes it from a
lookup); the synchronisations all-gather those rows instead of summing the whole
table when that puts fewer bytes on the wire (``SparseOptions``); the sparse
optimisers (``sparse_sgd``, ``sparse_adagrad``, ``apply_sparse_updates``) update
only those rows. Every name here is also ``jaxsync.NAME``.

This area plugs into the core's synchronisation where a tree is split into its
dense and ``RowSparse`` leaves (``_sync.sync_mixed``), and checks ``sparse=``.
"""

from jaxsync._core import _plugins

from ._grad import row_sparse_grad
from ._optim import apply_sparse_updates, densify, sparse_adagrad, sparse_sgd
from ._rows import RowSparse, SparseOptions, check_options, has_row_sparse
from ._sync import sync_mixed

_plugins.register_tree_kind(_plugins.TreeKind("row_sparse", has_row_sparse, sync_mixed))
_plugins.register_option("sparse", check_options)

__all__ = [
    "RowSparse",
    "SparseOptions",
    "apply_sparse_updates",
    "densify",
    "row_sparse_grad",
    "sparse_adagrad",
    "sparse_sgd",
]

"""Row-sparse test data shared by worker_sparse.py and test_sparse_mpi.py.

Global replica ``g`` (``rank * local_devices + local index``) holds integer-valued
rows at known indices, one of them duplicated; the mean over ``R`` replicas of
the scattered gradients is computed in float64 (exact: powers of two).
"""

import numpy as np

V, D, K = 256, 3, 3


def rows(g, dtype=np.float32, k=K):
    idx = np.array([(3 * g) % V, (5 * g + 1) % V, (3 * g) % V, (7 * g + 2) % V][:k], np.int32)
    vals = (np.arange(k * D).reshape(k, D) % 7 + g + 1).astype(dtype)
    return idx, vals


def dense_of(idx, vals):
    out = np.zeros((V, *vals.shape[1:]), np.float64)
    np.add.at(out, idx, vals.astype(np.float64))
    return out


def expected(n, dtype=np.float32, reduce="mean"):
    tot = sum(dense_of(*rows(g, dtype)) for g in range(n))
    return (tot / n if reduce == "mean" else tot).astype(dtype)

"""selftest's check values: each case's gradients and the closed form of its
result, exact for any replica count.

Used by ``_selftest_cases`` (the cases that run them) and the tests. Imports
numpy, and jax.numpy inside functions for dtypes: nothing of jaxsync.

The check values are exact for any replica count ``N`` (global replica
``r = process * local devices + device``) up to ``MAX_REPLICAS``, on every path
(the predivision by a power-of-two ``N``, the sum of each stage rounded once to
its wire dtype: a process's devices, a host's processes, the hosts): element
``j`` of leaf ``i`` of ``TREE`` (sorted by name) on replica ``r`` is

* on a 32-bit wire ``c + h_r + d_rj``, with ``c = (i + 1)(t + 1)`` at step ``t``
  (0-based), ``h_r`` = +1 for the first ``N // 2`` replicas, -1 for the last
  ``N // 2`` (0 for the middle one of an odd ``N``) and ``d_rj`` = +1 on replica
  ``j mod N``, -1 on replica ``(j + 1) mod N`` (they cancel for ``N = 1``), else
  0: the mean is ``c`` and every partial sum an integer of magnitude at most
  ``N (c + 2) < 2**24``, exact in float32; a replica counted twice or missed,
  a stage skipped or a wrong division changes the result;
* on a 16-bit wire (a bfloat16 leaf, or ``comm_dtype=bfloat16``)
  ``e_r + d_rj``, with ``e_r = s 2**-t`` (``s = (-1)**i``) on the first ``K``
  replicas and 0 on the others: ``K`` is the largest ``o 2**a <= min(N, 254)``
  (``o`` the odd part of ``N``), so ``K / N`` is a power of two and the mean
  ``s 2**-t K / N`` is a non-zero bfloat16 (a sync returning zeros fails). In
  units of ``2**-t`` the values are integers whose positive (negative) parts
  sum to at most ``K + 2 <= 256`` (2), so every partial sum is exact in
  bfloat16. When ``o > 254`` (``N`` like 257) no ``K`` exists, and no non-zero
  mean is exact either (the wire carries the sum ``N m``, and no non-zero
  bfloat16 ``m`` has ``N m`` in bfloat16): ``d_rj`` alone, mean 0.

``powersgd_mean``'s leaf (:func:`low_rank_values`) is exactly rank 2 with a
factor shared by every replica, its result within :func:`powersgd_tolerance` of
the mean; ``sign_mean``'s (:func:`sign_values`) has EF-SignSGD's result over two
steps in closed form, every sum an exact float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# The lossless cases' tree: leaf name -> (shape, dtype).
TREE: dict[str, tuple[tuple[int, ...], str]] = {
    "a": ((3, 5), "float32"),
    "b": ((7,), "bfloat16"),
    "c": ((1024,), "float32"),
    "d": ((), "float32"),
}
# The check values are exact up to this many replicas (N (c + 2) < 2**24, c <= 8).
MAX_REPLICAS = 2**20
# powersgd_mean: its compressed leaf and its rank.
POWERSGD_LEAF = "w"
POWERSGD_SHAPE = (16, 8)
POWERSGD_RANK = 2
# sign_mean compresses the leaves of at least min_size (default 256) values: c.
SIGN_LEAF = "c"


def _check_replicas(n: int) -> None:
    if not 1 <= n <= MAX_REPLICAS:
        raise ValueError(
            f"selftest: the check values are exact for 1 to {MAX_REPLICAS} replicas, got "
            f"{n}. Fix: run selftest on at most {MAX_REPLICAS} replicas (processes x "
            "devices)."
        )


def _halves(n: int, rows: np.ndarray) -> np.ndarray:
    """``h_r``: +1 for the first ``n // 2`` replicas, -1 for the last ``n // 2``, else 0."""
    return np.where(rows < n // 2, 1, np.where(rows >= n - n // 2, -1, 0))


def _pair(n: int, rows: np.ndarray, size: int) -> np.ndarray:
    """``d_rj`` ``(len(rows), size)``: +1 on replica ``j mod n``, -1 on ``(j + 1) mod n``."""
    j = np.arange(size)
    r = rows[:, None]
    return (r == j % n).astype(np.int64) - (r == (j + 1) % n).astype(np.int64)


def exact_values(
    n: int, rows: Sequence[int], index: int, shape: tuple, dtype, step: int = 0, comm_dtype=None
) -> tuple[np.ndarray, np.ndarray]:
    """A lossless case's leaf: the values of replicas ``rows`` and their mean.

    Args:
      n: the replica count (processes x local devices), 1 to ``MAX_REPLICAS``.
      rows: global replica indices (``process * local devices + device``).
      index: the leaf's position in the tree (its name's order), 0 to 3.
      shape: the leaf's shape.
      dtype: the leaf's dtype.
      step: the step (0 or 1): the 32-bit constant is ``(index + 1)(step + 1)``.
      comm_dtype: the wire dtype (``None``: the leaf's own).

    Returns:
      ``(values, mean)``: float64 arrays ``(len(rows), *shape)`` and ``shape``,
      every value exact in ``dtype`` and on the wire, the mean exact in ``dtype``
      (see the module's docstring for why every partial sum is exact too).
    """
    import jax.numpy as jnp

    _check_replicas(n)
    if not (0 <= index <= 3 and step in (0, 1)):
        raise ValueError(
            f"selftest: exact_values takes index 0 to 3 and step 0 or 1, got index "
            f"{index}, step {step}. Fix: pass a leaf of TREE and step 0 or 1."
        )
    r = np.asarray(rows, np.int64)
    size = int(np.prod(shape, dtype=np.int64))
    pair = _pair(n, r, size)
    wire = jnp.dtype(comm_dtype if comm_dtype is not None else dtype)
    if wire.itemsize < 4 or jnp.dtype(dtype).itemsize < 4:
        k = low_wire_count(n)
        e = (-1.0) ** index * 2.0**-step * (r < k)
        values = e[:, None] + pair.astype(np.float64)
        mean = np.full(shape, (-1.0) ** index * 2.0**-step * k / n)
    else:
        c = (index + 1) * (step + 1)
        values = (c + _halves(n, r)[:, None] + pair).astype(np.float64)
        mean = np.full(shape, float(c))
    return values.reshape(len(r), *shape), mean


def low_wire_count(n: int) -> int:
    """``K``: how many replicas hold the 16-bit wire's constant (0: none can).

    The largest ``o 2**a`` at most ``min(n, 254)``, ``o`` the odd part of ``n``
    (``K / n`` a power of two), or 0 when ``o > 254``.
    """
    odd = n // (n & -n)
    k = 0 if odd > 254 else odd
    while k and 2 * k <= min(n, 254):
        k *= 2
    return k


# A rank-2 (16, 8) matrix per replica with the shared factor A: A (B0 + h_r B1)^T.
_A = np.array([[(i % 5) - 2, ((3 * i) % 7) - 3] for i in range(16)], np.float64)
_B0 = np.array([[(j % 3) + 1, (j % 4) - 2] for j in range(8)], np.float64)
_B1 = np.array([[1, j % 2] for j in range(8)], np.float64)


def low_rank_values(n: int, rows: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """PowerSGD's leaf: replica ``r``'s ``A (B0 + h_r B1)^T`` and the mean ``A B0^T``."""
    _check_replicas(n)
    h = _halves(n, np.asarray(rows, np.int64)).astype(np.float64)
    b = _B0[None] + h[:, None, None] * _B1[None]
    return np.einsum("nk,rmk->rnm", _A, b), _A @ _B0.T


def sign_values(n: int, rows: Sequence[int], size: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """sign_mean's leaf (the same gradient at both steps) and step ``step``'s result.

    Replica ``r``'s value ``j`` is ``sigma m_j s_r``: ``sigma`` = -1 where ``(j + r)``
    is a multiple of 3 (else +1), ``m_j`` = 1/4 (``j`` even) or 7/4 (odd), ``s_r``
    = 1 + (r mod 3). Step 0 sends ``s_r sigma`` (scale ``s_r``: the magnitudes
    average 1), keeping ``sigma s_r (m - 1)``; step 1 compresses
    ``sigma s_r (2m - 1)``: scale ``1.5 s_r``, signs ``sigma`` (-``sigma`` where
    ``m = 1/4``). Every sum is exact in float32; the result is their sum over the
    ``n`` replicas divided by ``n`` in float32 (correctly rounded), as float64.
    """
    _check_replicas(n)
    if size % 2 or step not in (0, 1):
        raise ValueError(
            f"selftest: sign_values takes an even size and step 0 or 1, got size {size}, "
            f"step {step}. Fix: pass the sign leaf's size and step 0 or 1."
        )
    j = np.arange(size)
    m = np.where(j % 2 == 0, 0.25, 1.75)

    def parts(r):
        sigma = np.where((j[None] + r[:, None]) % 3 == 0, -1.0, 1.0)
        return sigma, (1 + r % 3).astype(np.float64)[:, None]

    sigma, s = parts(np.asarray(rows, np.int64))
    every_sigma, every_s = parts(np.arange(n, dtype=np.int64))
    if step == 0:
        sent = every_s * every_sigma
    else:
        sent = 1.5 * every_s * every_sigma * np.where(m < 1, -1.0, 1.0)
    total = sent.sum(axis=0)  # small multiples of 1/2: exact in float32 too
    want = (total.astype(np.float32) / np.float32(n)).astype(np.float64)
    return sigma * m * s, want


def powersgd_tolerance(n: int) -> float:
    """The largest error of powersgd's result over ``n`` replicas, relative to ``max |A B0^T|``.

    ``1e-5 + 4 n eps`` (``eps = 2**-23``, float32's): its float32 means over ``n``
    replicas err by up to about ``n eps`` of the terms' magnitude (measured: 0.2
    to 0.35 ``n eps`` for 8 to 1024 replicas); a wrong result is off by order 1.
    """
    return 1e-5 + 4 * n * 2.0**-23

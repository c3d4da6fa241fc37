"""Summing the rows of 16-bit data in float32 with a graph of constant size.

``rows_sum_f32`` replaces ``_strategies._rows_sum_f32``, which unrolls ``k - 1``
adds: with ``k`` = the number of processes (or local devices) the traced graph,
and the compile time, grew with the job size.

May import: JAX only (``_strategies`` imports it).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

# Up to this many rows the adds are unrolled (what XLA's CPU backend runs
# fastest: a column reduction jnp.sum(axis=0) of a (2, 2.75M) array took 70 ms,
# the adds 1 ms); beyond it a loop keeps the graph O(1) in k.
UNROLL = 8


def rows_sum_f32(rows):
    """Sum the rows of a ``(k, m)`` array in float32, strictly in row order.

    The result is the left fold ``((r0 + r1) + r2) + ...`` with each row
    converted to float32 and each add rounded to float32, for every ``k``: bit
    for bit what the unrolled adds gave (for ``k <= UNROLL`` it is those adds;
    beyond, a ``lax.fori_loop`` of the same adds in the same order), so results
    do not depend on the process count through the graph's shape. The traced
    graph has at most ``UNROLL`` adds whatever ``k`` is.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxsync._core._reduce16 import rows_sum_f32
      >>> rows_sum_f32(jnp.ones((1000, 2), jnp.bfloat16))
      Array([1000., 1000.], dtype=float32)
    """
    k = rows.shape[0]
    acc = rows[0].astype(jnp.float32)
    if k <= UNROLL:
        for i in range(1, k):
            acc = acc + rows[i].astype(jnp.float32)
        return acc

    def body(i, acc):
        row = lax.dynamic_index_in_dim(rows, i, axis=0, keepdims=False)
        return acc + row.astype(jnp.float32)

    return lax.fori_loop(1, k, body, acc)

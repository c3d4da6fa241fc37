"""``jaxsync.clip_by_global_norm``: optax's, correct inside :func:`jaxsync.sharded`.

Outside ``sharded`` it is ``optax.clip_by_global_norm`` itself. Inside, each
replica holds a slice of every leaf (zeros where a leaf is padded), so the
global norm is the square root of the sum over every replica of each
replica's sum of squares: one scalar crosses the replicas, and every replica
scales its slice by the same factor.

Imports: ``_elementwise``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from . import _elementwise


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """Clip updates to a global norm, as ``optax.clip_by_global_norm``.

    Use it instead of optax's inside :func:`jaxsync.sharded`, where a replica
    holds a slice of each leaf: the norm is then summed over every replica
    (one scalar more on the wire). Outside ``sharded`` it is
    ``optax.clip_by_global_norm(max_norm)``, the same updates bit for bit.

    Args:
      max_norm: the largest global L2 norm the updates may have (> 0).

    Returns:
      an optax ``GradientTransformation`` with optax's (empty) state.

    Raises:
      ValueError: ``max_norm`` is not a positive number.

    Example:
      >>> import jax.numpy as jnp, jaxsync
      >>> tx = jaxsync.clip_by_global_norm(1.0)
      >>> u, _ = tx.update({"w": jnp.array([3.0, 4.0])}, tx.init(None))
      >>> u["w"]
      Array([0.6, 0.8], dtype=float32)
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(
            f"clip_by_global_norm: max_norm must be a positive number, got {max_norm!r}. "
            "Fix: e.g. jaxsync.clip_by_global_norm(1.0)."
        )
    plain = optax.clip_by_global_norm(max_norm)

    def update_fn(updates, state, params=None):
        allsum = _elementwise.allsum()
        if allsum is None:  # not inside sharded: optax's own
            return plain.update(updates, state, params)
        leaves = jax.tree.leaves(updates)
        if not leaves:
            return updates, state
        norm = jnp.sqrt(allsum(_local_sumsq(leaves)))
        trigger = jnp.squeeze(norm < max_norm)

        def clip(t):
            return jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm)

        return jax.tree.map(clip, updates), state

    return optax.GradientTransformation(plain.init, update_fn)


def _local_sumsq(leaves):
    # Named so that sharded's elementwise check knows this reduction is ours.
    def _jaxsync_global_sum(xs):
        # optax's order: each leaf's sum of squares, then the leaves' sum
        total = jnp.sum(jnp.square(xs[0]))
        for x in xs[1:]:
            total = total + jnp.sum(jnp.square(x))
        return total

    _jaxsync_global_sum.__name__ = _elementwise.GLOBAL_NAME
    return jax.jit(_jaxsync_global_sum)(leaves)

"""``sharded(..., accumulate=k)``: ZeRO-2's gradient accumulation on the slices.

Every micro-step's gradients are reduce-scattered as usual and added to this
replica's ``1/N`` accumulator (a slice of every leaf); at every ``k``-th
micro-step the inner optimizer runs once on the accumulated mean and the
updates are all-gathered. The micro-steps in between all-gather nothing and
return zero updates. The choice is a ``lax.cond`` on the micro-step count,
the same on every replica, so every replica gathers at the same call.

The state keeps the inner optimizer's state first (``ShardedState.inner`` is
an :class:`AccumulatedState`): its leaves' per-replica flags come first, in
the order of the inner state's own.

Imports: ``jaxsync._comm._invariance`` (axis types).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxsync._comm import _invariance


class AccumulatedState(NamedTuple):
    """The inner state of ``sharded(..., accumulate=k)``.

    Attributes:
      inner: the inner optimizer's state (of this replica's slices).
      acc: the sum of the micro-steps' reduced gradient slices since the last
        update (this replica's ``1/N``).
      mini_step: micro-steps accumulated since then (the same everywhere).
    """

    inner: Any
    acc: Any
    mini_step: Any


def wrapped_init(inner: optax.GradientTransformation, every: int):
    """A transformation whose ``init`` makes the accumulated state of slices
    (only ``init`` is used: for the state's structure and per-replica flags)."""

    def init(slices):
        acc = jax.tree.map(jnp.zeros_like, slices)
        return AccumulatedState(inner.init(slices), acc, jnp.zeros([], jnp.int32))

    del every
    return optax.GradientTransformation(init, lambda u, s, p=None: (u, s))


def step(every: int, state: AccumulatedState, g_tree, apply):
    """One micro-step: add ``g_tree`` (this replica's reduced slices) to the
    accumulator; at the ``every``-th, ``apply(mean_tree, inner_state) ->
    (full_updates, inner_state)`` (the inner update and the all-gather).
    Returns the updates (zeros between) and the new :class:`AccumulatedState`."""
    acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), state.acc, g_tree)
    last = state.mini_step == every - 1
    seen: list = []

    def fire(acc, inner_state):
        mean = jax.tree.map(lambda a: a / jnp.asarray(every, a.dtype), acc)
        full, inner_state = apply(mean, inner_state)
        seen.append((full, inner_state))
        return full, inner_state, jax.tree.map(jnp.zeros_like, acc)

    def wait(acc, inner_state):
        # typed as the gathering branch's (lax.cond traces it first)
        if not seen:
            raise RuntimeError("sharded: internal: the gathering branch was not traced first")
        full, like = seen[0]
        zeros = jax.tree.map(lambda x: _as(jnp.zeros(x.shape, x.dtype), x), full)
        return zeros, jax.tree.map(_as, inner_state, like), acc

    full, inner_state, acc = lax.cond(last, fire, wait, acc, state.inner)
    count = jnp.where(last, 0, state.mini_step + 1).astype(jnp.int32)
    return full, AccumulatedState(inner_state, acc, count)


def _as(x, like):
    """``x`` typed varying over the axes ``like`` varies over (shard_map)."""
    return _invariance._varying(x, _invariance._vma(like))

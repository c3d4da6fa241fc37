"""Resuming a local-update run on another island count: :func:`regroup`.

What the islands share (the step count, the float32 anchor, the outer
optimizer's state, the skip count, the held means) is the same on every island,
checked bit for bit; what each island holds alone is its inner state and its
divergence flags. A new island takes those of saved island ``i % N``; islands
beyond the new count are merged away (their inner state is dropped).

May import: numpy, JAX, ``_state``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from ._state import LocalUpdatesState

_SHARED = ("step", "anchor", "outer_state", "skipped", "held")


def regroup(states: Sequence[LocalUpdatesState], islands: int) -> list[LocalUpdatesState]:
    """The states of ``islands`` islands from the states ``N`` islands saved.

    Every island of a run holds the same step count, anchor, outer state and held
    means (checked here, bit for bit: states of one run at one step); island
    ``i`` of the new run takes them and the inner state of saved island
    ``i % N``. So with more islands, a new island starts from a copy of an old
    island's inner state (Adam's moments, say); with fewer, islands ``islands``
    to ``N - 1`` are dropped with their inner state. Their parameters are not in
    the state: save them right after an outer step (every island's parameters
    are then the anchor, cast to the parameters' dtype) and give each new
    island those. Make the new run's transform for the new count (``bmuf``'s
    default block momentum, ``1 - 1/N``, follows it). A state with a sum in
    flight (``overlap=True``) must be saved after its apply step.

    Args:
      states: each saved island's state (one process's, for islands of one
        process; any process of the island, for larger ones), in island order.
      islands: the new run's island count (>= 1).

    Returns:
      one state per new island, in island order.

    Raises:
      ValueError: the states differ in what islands share (not one run's, or not
        one step's), or hold a sum in flight.

    Example:
      >>> import jax.numpy as jnp, optax, jaxsync
      >>> tx = jaxsync.diloco(optax.adam(0.1), every=4, islands=jaxsync.islands(comm=None))
      >>> saved = [tx.init({"w": jnp.ones(2)}) for _ in range(2)]  # two islands' states
      >>> new = jaxsync.local.regroup(saved, islands=3)
      >>> len(new), new[2].inner_state is saved[0].inner_state  # island 2 takes 0's
      (3, True)
    """
    fn = "regroup"
    states = list(states)
    if not states or not all(isinstance(s, LocalUpdatesState) for s in states):
        got = [type(s).__name__ for s in states]
        raise TypeError(
            f"{fn}: states must be a non-empty sequence of LocalUpdatesState (one per "
            f"saved island), got {got}. Fix: pass each island's saved optimizer state."
        )
    if isinstance(islands, bool) or not isinstance(islands, int) or islands < 1:
        raise ValueError(
            f"{fn}: islands must be a Python int >= 1 (the new run's island count), got "
            f"{islands!r}. Fix: e.g. islands=len(new_hosts)."
        )
    first = states[0]
    for name in _SHARED:
        want, tdef = jax.tree.flatten(getattr(first, name))
        for i, s in enumerate(states[1:], 1):
            got, gdef = jax.tree.flatten(getattr(s, name))
            same = str(gdef) == str(tdef) and all(
                np.shape(a) == np.shape(b)
                and np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)
                for a, b in zip(got, want)
            )
            if not same:
                raise ValueError(
                    f"{fn}: island {i}'s {name} differs from island 0's; every island of "
                    "a run holds the same one at every step. Fix: pass the states all "
                    "islands saved at one step of one run."
                )
    flying = [
        int(np.asarray(h))
        for h in jax.tree.leaves(first.held)
        if np.ndim(h) == 0 and np.asarray(h).dtype == np.int32 and int(np.asarray(h)) >= 0
    ]
    if flying:
        raise ValueError(
            f"{fn}: the states hold {len(flying)} sum(s) in flight (overlap=True; handles "
            f"{flying}), whose handles name this process's transfers. Fix: save after "
            "the fragment's apply step, or use the held form (overlap=False)."
        )
    n = len(states)
    return [
        first._replace(inner_state=states[i % n].inner_state, diverged=states[i % n].diverged)
        for i in range(islands)
    ]

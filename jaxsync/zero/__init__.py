"""Sharded optimizer state (ZeRO for optax): ``jaxsync.sharded``.

``sharded(inner, axis_name=...)`` reduce-scatters the gradients so that each
replica holds the mean of a 1/N slice of every leaf, runs ``inner`` on the
slices and all-gathers the updates: the optimizer's state and compute per
replica are 1/N of the whole, and the bytes on the wire those of one
allreduce. ``clip_by_global_norm`` clips correctly on slices;
``gather_state``, ``shard_state``, ``state_shapes`` and ``reshard_state`` move
a saved state between world sizes.
"""

from ._checkpoint import gather_state, shard_state
from ._clip import clip_by_global_norm
from ._reshard import reshard_state, state_shapes
from ._sharded import ShardedState
from ._transform import sharded

__all__ = [
    "ShardedState",
    "clip_by_global_norm",
    "gather_state",
    "reshard_state",
    "shard_state",
    "sharded",
    "state_shapes",
]

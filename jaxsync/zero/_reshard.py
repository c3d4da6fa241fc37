"""Sharded states between worlds without the whole state: ``state_shapes`` and
``reshard_state``.

``state_shapes`` gives the shapes any rank of any world holds (the target to
restore its saved part, e.g. with orbax); ``reshard_state`` makes this rank's
part for a new world from the parts another world saved, loading only those
whose slices overlap its own (a leaf's slices are consecutive runs of its
elements): no rank holds the whole state. Both run on the host (numpy),
outside any step.

Imports: ``_layout``, ``_sharded``, ``_checkpoint``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._checkpoint import _counts, _part_shape, _same
from ._layout import make_layout
from ._sharded import ShardedState, per_replica_flags


def state_shapes(
    inner: optax.GradientTransformation,
    params: Any,
    *,
    replicas: int,
    process: int = 0,
    processes: int = 1,
    check_finite: bool = False,
) -> ShardedState:
    """The shapes of one process's :class:`jaxsync.ShardedState`, in any world.

    What rank ``process`` of a run of ``replicas`` replicas over ``processes``
    processes holds (its devices' slices, stacked), as ``jax.ShapeDtypeStruct``
    leaves: the target to restore that rank's saved part from another world
    (``orbax``'s ``restore(path, target)``), for :func:`jaxsync.reshard_state`.

    Args:
      inner: the optimizer given to :func:`jaxsync.sharded`.
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``s).
      replicas: the replica count of that run (devices x processes).
      process: the rank.
      processes: the run's process count.
      check_finite: the ``check_finite`` of the sharded transform.

    Returns:
      a :class:`jaxsync.ShardedState` of ``jax.ShapeDtypeStruct``s.

    Example:
      >>> import jax.numpy as jnp, optax, jaxsync
      >>> inner, params = optax.adam(0.1), {"w": jnp.ones((5, 3))}
      >>> shapes = jaxsync.state_shapes(inner, params, replicas=4, process=1, processes=2)
      >>> shapes.inner[0].mu["w"].shape  # 2 devices' (1, 4) slices
      (2, 4)
    """
    _counts("state_shapes", replicas, process, processes)
    devices = replicas // processes
    layout = make_layout(params, devices, processes, "state_shapes")
    flags = per_replica_flags(inner, layout)
    whole = jax.eval_shape(inner.init, params)
    w_flat, w_def = jax.tree.flatten(whole)
    out = [
        jax.ShapeDtypeStruct(_part_shape(w.shape, replicas, devices) if f else w.shape, w.dtype)
        for w, f in zip(w_flat, flags)
    ]
    finite = jax.ShapeDtypeStruct((), jnp.bool_) if check_finite else None
    return ShardedState(jax.tree_util.tree_unflatten(w_def, out), finite, flags)


def reshard_state(
    inner: optax.GradientTransformation,
    params: Any,
    load: Callable[[int], Any],
    *,
    saved_replicas: int,
    saved_processes: int,
    replicas: int,
    process: int = 0,
    processes: int = 1,
    check_finite: bool = False,
) -> ShardedState:
    """This process's :class:`jaxsync.ShardedState` for a new world, made from
    the parts another world saved, without the whole state.

    Each leaf's slices are consecutive runs of its elements, so this rank's
    part for ``replicas`` replicas overlaps the parts of a few saved ranks
    only: ``load(q)`` is called for those (once each) and gives saved rank
    ``q``'s state (a :class:`jaxsync.ShardedState`, or its ``inner``; e.g. its
    orbax checkpoint restored into :func:`jaxsync.state_shapes`).

    Args:
      inner: the optimizer given to :func:`jaxsync.sharded`.
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``s).
      load: saved rank -> its state.
      saved_replicas: the saving run's replica count (devices x processes).
      saved_processes: the saving run's process count.
      replicas: the new run's replica count.
      process: this process's rank in the new run.
      processes: the new run's process count.
      check_finite: the ``check_finite`` of the new run's sharded transform.

    Returns:
      the state of process ``process``, equal to ``shard_state(inner,
      gather_state(inner, every saved state, params), params, ...)``.

    Raises:
      ValueError: the counts do not fit, or a loaded state is not ``inner``'s
        for ``params`` in the saving world.

    Example:
      >>> import jax.numpy as jnp, optax, jaxsync
      >>> inner, params = optax.adam(0.1), {"w": jnp.arange(15.0).reshape(5, 3)}
      >>> whole = (optax.ScaleByAdamState(jnp.array(0), params, params), optax.EmptyState())
      >>> saved = [jaxsync.shard_state(inner, whole, params, replicas=4, process=q,
      ...                              processes=4) for q in range(4)]
      >>> loaded = []
      >>> mine = jaxsync.reshard_state(inner, params, lambda q: loaded.append(q) or saved[q],
      ...                              saved_replicas=4, saved_processes=4, replicas=3,
      ...                              process=2, processes=3)
      >>> loaded  # w's 15 elements: saved ranks hold 4 each, the new rank 2 holds 10..14
      [2, 3]
      >>> mine.inner[0].mu["w"].tolist()
      [[10.0, 11.0, 12.0, 13.0, 14.0]]
    """
    fn = "reshard_state"
    _counts(fn, saved_replicas, 0, saved_processes, "saved_")
    _counts(fn, replicas, process, processes)
    devices, saved_devices = replicas // processes, saved_replicas // saved_processes
    new_shapes = state_shapes(
        inner, params, replicas=replicas, process=process, processes=processes
    )
    w_flat, w_def = jax.tree.flatten(jax.eval_shape(inner.init, params))
    paths = [
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(new_shapes.inner)[0]
    ]
    flags = new_shapes.per_replica
    cache: dict[int, list] = {}

    def part(q: int) -> list:
        if q not in cache:
            got = load(q)
            got = got.inner if isinstance(got, ShardedState) else got
            leaves, treedef = jax.tree.flatten(got)
            if str(treedef) != str(w_def):
                raise ValueError(
                    f"{fn}: load({q}) gave a state of structure {treedef}, and inner.init"
                    f"(params) has {w_def}. Fix: load the parts saved with this optimizer "
                    "and these parameters."
                )
            want = state_shapes(
                inner, params, replicas=saved_replicas, process=q, processes=saved_processes
            )
            for name, x, w in zip(paths, leaves, jax.tree.leaves(want.inner)):
                _same(fn, name, np.shape(x), tuple(w.shape))
            cache[q] = [np.asarray(x) for x in leaves]
        return cache[q]

    out: list = [None] * len(w_flat)
    for j, (w, f) in enumerate(zip(w_flat, flags)):
        if not f:
            continue
        n = int(np.prod(w.shape))
        k, sk = -(-n // replicas), -(-n // saved_replicas)
        lo, hi = process * devices * k, min((process + 1) * devices * k, n)
        flat = np.zeros(devices * k, w.dtype)
        span = saved_devices * sk  # the elements of each saved rank
        for q in range(lo // span, -(-hi // span)) if hi > lo else ():
            a, b = max(lo, q * span), min(hi, (q + 1) * span)
            flat[a - lo : b - lo] = part(q)[j].reshape(-1)[a - q * span : b - q * span]
        out[j] = jnp.asarray(flat.reshape(_part_shape(w.shape, replicas, devices)))
    for j, f in enumerate(flags):  # the same on every saved rank: one already loaded
        if not f:
            out[j] = jnp.asarray(part(min(cache, default=0))[j])
    finite = jnp.array(True) if check_finite else None
    return ShardedState(jax.tree_util.tree_unflatten(w_def, out), finite, flags)

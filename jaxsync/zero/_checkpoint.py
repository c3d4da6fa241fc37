"""Sharded states across world sizes: ``gather_state`` and ``shard_state``.

Each process saves its own :class:`jaxsync.ShardedState` (its devices'
slices, stacked along a leading axis). ``gather_state`` joins the processes'
states into the inner optimizer's whole state, the one
``optax.chain(jaxsync.hierarchical_mean(...), inner)`` would hold (given
every state, or, with ``comm``, each rank's own, gathered leaf by leaf to one
rank); ``shard_state`` cuts a whole state for another number of replicas.
Both run on the host (numpy), outside any step; ``_reshard`` moves a state
between worlds without the whole of it.

Imports: ``_layout``, ``_sharded`` (``gather_state``'s ``comm``: an mpi4py
communicator, used as given).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._layout import make_layout, slice_shape
from ._sharded import ShardedState, per_replica_flags


def gather_state(
    inner: optax.GradientTransformation,
    states: ShardedState | Sequence[ShardedState],
    params: Any,
    *,
    replicas: int | None = None,
    comm: Any = None,
    root: int = 0,
) -> Any:
    """The inner optimizer's whole state from the processes' sharded states.

    Args:
      inner: the optimizer given to :func:`jaxsync.sharded`.
      states: every process's state, in rank order (one state when one process
        holds every replica), each as its step holds it: the slices of its
        devices stacked along the leaves' first axis.
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``s): the shapes
        the state follows.
      replicas: the replica count of the run that saved the states; read from
        the states when None (it needs it only when every parameter is a
        vector and their lengths fit several counts).
      comm: an mpi4py communicator: every rank passes its own state
        (``states``: one), the slices go to rank ``root`` leaf by leaf
        (``comm.gather``), and only ``root`` gets the whole state (to save it
        as one checkpoint); the other ranks get None.
      root: with ``comm``, the rank that gets the whole state.

    Returns:
      the state ``inner.init(params)`` has the structure of, holding the
      sharded state's values (numpy arrays); with ``comm``, None on every rank
      but ``root``.

    Raises:
      ValueError: the states do not belong together (structure, replica count)
        or to ``inner`` and ``params``.

    Example:
      >>> import jax.numpy as jnp, optax, jaxsync
      >>> inner, params = optax.adam(0.1), {"w": jnp.ones((5, 3))}
      >>> whole = inner.init(params)
      >>> parts = [jaxsync.shard_state(inner, whole, params, replicas=4, process=p,
      ...                              processes=2) for p in range(2)]
      >>> parts[0].inner[0].mu["w"].shape  # 2 devices' (1, 4) slices, stacked
      (2, 4)
      >>> back = jaxsync.gather_state(inner, parts, params)
      >>> back[0].mu["w"].shape
      (5, 3)
    """
    fn = "gather_state"
    if comm is not None:
        return _gather_to_root(inner, states, params, replicas, comm, root)
    if isinstance(states, ShardedState):
        states = [states]
    states = list(states)
    if not states or not all(isinstance(s, ShardedState) for s in states):
        raise TypeError(
            f"{fn}: states must be a ShardedState or a sequence of them (one per "
            f"process), got {type(states).__name__}. Fix: pass what each process's "
            "sharded transform holds, in rank order."
        )
    flags = states[0].per_replica
    for r, s in enumerate(states[1:], 1):
        if s.per_replica != flags:
            raise ValueError(
                f"{fn}: states[{r}] and states[0] differ in which leaves are slices: "
                "states of one run are expected. Fix: pass the states every process "
                "of one run saved at the same step."
            )
    whole = jax.eval_shape(inner.init, params)
    w_flat, w_def = jax.tree_util.tree_flatten_with_path(whole)
    parts = [jax.tree.flatten(s.inner) for s in states]
    for r, (_, treedef) in enumerate(parts):
        if str(treedef) != str(w_def):
            raise ValueError(
                f"{fn}: states[{r}].inner has the structure {treedef}, and inner.init"
                f"(params) {w_def}. Fix: pass the optimizer and parameters the states "
                "were made with."
            )
    n = replicas if replicas is not None else _replicas(flags, w_flat, parts)
    out = []
    for j, ((path, w), f) in enumerate(zip(w_flat, flags)):
        name = jax.tree_util.keystr(path)
        if not f:
            x = np.asarray(parts[0][0][j])
            _same(fn, name, x.shape, tuple(w.shape))
            out.append(x)
            continue
        rows = np.concatenate([np.asarray(p[0][j]) for p in parts], axis=0)
        size = int(np.prod(w.shape))
        k = -(-size // n)
        one = slice_shape(tuple(w.shape), k)
        _same(fn, name, rows.shape, (n * one[0], *one[1:]))
        out.append(rows.reshape(-1)[:size].reshape(w.shape))
    return jax.tree_util.tree_unflatten(w_def, out)


def shard_state(
    inner: optax.GradientTransformation,
    state: Any,
    params: Any,
    *,
    replicas: int,
    process: int = 0,
    processes: int = 1,
    check_finite: bool = False,
) -> ShardedState:
    """One process's :class:`jaxsync.ShardedState` cut from a whole state.

    Args:
      inner: the optimizer given to :func:`jaxsync.sharded`.
      state: the inner optimizer's whole state (from :func:`jaxsync.gather_state`,
        or ``optax.chain(jaxsync.hierarchical_mean(...), inner)``'s second part).
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``s).
      replicas: the replica count of the run that will use the state (devices
        x processes).
      process: this process's rank.
      processes: the run's process count (``replicas`` a multiple of it).
      check_finite: the ``check_finite`` of the sharded transform (it keeps
        ``all_finite`` in its state).

    Returns:
      the state of process ``process``: its devices' slices, stacked.

    Raises:
      ValueError: the counts do not fit, or ``state`` is not ``inner``'s state
        for ``params``.

    Example:
      >>> import jax.numpy as jnp, optax, jaxsync
      >>> inner, params = optax.sgd(0.1, momentum=0.9), {"w": jnp.ones((3, 2))}
      >>> mine = jaxsync.shard_state(inner, inner.init(params), params, replicas=2)
      >>> mine.inner[0].trace["w"].shape  # one process, 2 devices' (1, 3) slices
      (2, 3)
    """
    fn = "shard_state"
    _counts(fn, replicas, process, processes)
    devices = replicas // processes
    layout = make_layout(params, devices, processes, fn)
    flags = per_replica_flags(inner, layout)
    whole = jax.eval_shape(inner.init, params)
    w_flat, w_def = jax.tree_util.tree_flatten_with_path(whole)
    got, got_def = jax.tree.flatten(state)
    if str(got_def) != str(w_def):
        raise ValueError(
            f"{fn}: state has the structure {got_def}, and inner.init(params) {w_def}. "
            "Fix: pass the inner optimizer's state (the second part of optax.chain("
            "hierarchical_mean(...), inner)'s state)."
        )
    out = []
    for (path, w), x, f in zip(w_flat, got, flags):
        x = np.asarray(x)
        _same(fn, jax.tree_util.keystr(path), x.shape, tuple(w.shape))
        if not f:
            out.append(jnp.asarray(x))
            continue
        k = -(-x.size // replicas)
        flat = np.zeros(replicas * k, x.dtype)
        flat[: x.size] = x.reshape(-1)
        part = flat[process * devices * k : (process + 1) * devices * k]
        out.append(jnp.asarray(part.reshape(_part_shape(w.shape, replicas, devices))))
    inner_state = jax.tree_util.tree_unflatten(w_def, out)
    finite = jnp.array(True) if check_finite else None
    return ShardedState(inner_state, finite, flags)


def _part_shape(shape, replicas: int, devices: int) -> tuple:
    """A process's part of a per-replica leaf: its devices' slices, stacked."""
    one = slice_shape(tuple(shape), -(-int(np.prod(shape)) // replicas))
    return (devices * one[0], *one[1:])


def _counts(fn, replicas, process, processes, prefix="") -> None:
    for name, v in (("replicas", replicas), ("processes", processes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{fn}: {prefix}{name} must be a positive int, got {v!r}.")
    if replicas % processes or not 0 <= process < processes:
        raise ValueError(
            f"{fn}: {prefix}replicas={replicas} over {prefix}processes={processes} with "
            f"process={process}: replicas must be a multiple of processes and 0 <= "
            "process < processes. Fix: replicas=devices per process x processes."
        )


def _gather_to_root(inner, state, params, replicas, comm, root):
    """``gather_state`` over ``comm``: each per-replica leaf gathered to
    ``root`` in turn (one leaf's parts at a time in flight)."""
    if not isinstance(state, ShardedState):
        raise TypeError(
            f"gather_state: with comm, states must be this rank's ShardedState, got "
            f"{type(state).__name__}. Fix: every rank passes its own state."
        )
    local = jax.device_get(state)
    leaves, treedef = jax.tree.flatten(local.inner)
    mine = comm.Get_rank() == root
    columns = []
    for x, f in zip(leaves, local.per_replica):
        got = comm.gather(np.asarray(x), root=root) if f else None
        columns.append(got)
    if not mine:
        return None
    every = [
        ShardedState(
            jax.tree_util.tree_unflatten(
                treedef, [c[r] if c is not None else x for c, x in zip(columns, leaves)]
            ),
            local.all_finite,
            local.per_replica,
        )
        for r in range(comm.Get_size())
    ]
    return gather_state(inner, every, params, replicas=replicas)


def _replicas(flags, w_flat, parts) -> int:
    """The replica count: how many slices the processes' states stack.

    A slice of a leaf of rank 0 or >= 2 has a first axis of 1: the stacked
    first axes count the replicas. A vector's slices are ``(k,)``: the counts
    whose slices fill the stacked length, common to every such leaf.
    """
    candidates: set | None = None
    for j, f in enumerate(flags):
        if not f:
            continue
        shape = tuple(w_flat[j][1].shape)
        if len(shape) != 1:
            return sum(int(np.shape(p[0][j])[0]) for p in parts)
        size, total = shape[0], sum(int(np.size(p[0][j])) for p in parts)
        fits = {n for n in range(1, total + 1) if n * -(-size // n) == total}
        candidates = fits if candidates is None else candidates & fits
    if candidates is None:
        return 1
    if len(candidates) != 1:
        raise ValueError(
            "gather_state: the states' vectors fit several replica counts "
            f"({sorted(candidates)}). Fix: pass replicas=devices x processes of the "
            "run that saved them."
        )
    return candidates.pop()


def _same(fn, name, got, want) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(
            f"{fn}: the state leaf {name} has shape {tuple(got)}, expected {tuple(want)}. "
            "Fix: pass the state, optimizer and parameters of one run."
        )

"""``diloco``: DiLoCo and Streaming DiLoCo as one optax transform that wraps
the whole optimizer.

May import: ``_state`` (the checks), ``_update`` (init and update); optax.
"""

from __future__ import annotations

from typing import Any

import optax

from ._state import make_local_config
from ._update import init_fn, update_fn

#: DiLoCo's outer optimizer (Douillard et al., 2023): Nesterov momentum 0.9, lr 0.7.
DILOCO_OUTER = optax.sgd(0.7, momentum=0.9, nesterov=True)


def diloco(
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation = DILOCO_OUTER,
    *,
    every: int,
    islands: Any = None,
    strategy: str = "hierarchical",
    comm_dtype: Any = None,
    timeout: float | None = None,
    reset_inner: bool = False,
    fragments: int = 1,
    labels: Any = None,
    mix: float = 0.0,
    delay: int = 0,
    overlap: bool = False,
    slice_anchor: bool = False,
) -> optax.GradientTransformation:
    """DiLoCo: ``every`` local steps per island, then one outer step.

    Wraps the whole optimizer. Every step runs ``inner`` (whose mean must stay
    inside the island: build it with ``axis_name=isl.axis_name, comm=isl.comm``
    of :func:`jaxsync.islands`; a mean that spans islands is refused when the
    step is traced). Every ``every`` steps: the pseudo-gradient ``anchor -
    params`` (float32) is averaged over the islands by jaxsync's ``strategy``
    (``comm_dtype`` on the wire), ``outer`` updates the anchor with it, and the
    parameters are reset to the new anchor. The anchor is kept in float32
    whatever the parameters' dtype; the inner state is kept across outer steps
    (as MaxText and torchft do) unless ``reset_inner``.

    If the averaged pseudo-gradient is not all finite (a diverged island), the
    outer step is skipped on every island (the decision is read from the synced
    mean, so it is the same everywhere): the anchor and outer state stay, the
    parameters are reset to the old anchor, and ``state.skipped`` counts it. An
    inner step that gives non-finite parameters between outer steps is not
    taken: the island idles at its last finite point, flagged
    (``state.diverged``), until an outer step (skipped: its pseudo-gradient
    travels as NaN) sets it back to the anchor.

    Its updates *set* the parameters at an outer step: as with
    ``optax.lookahead``, chain nothing after it and do not wrap it in
    ``optax.MultiSteps`` or ``optax.apply_if_finite`` (they would rescale or drop
    an update that must land as it is; put such transforms in ``inner``). Every
    island must start from the same parameters (:func:`jaxsync.broadcast_params`).

    Streaming DiLoCo (Douillard et al., 2025): ``fragments=P`` splits the leaves
    into ``P`` groups (strided over the leaves: leaf ``k`` in group ``k % P``,
    or ``labels``, a pytree of ints like the parameters) that take their outer
    step in turn, one every ``every / P`` steps. ``delay=tau`` applies a
    fragment's outer step ``tau`` inner steps after its pseudo-gradient was
    sent; ``mix=alpha`` sets the fragment to ``(1 - alpha) * outer result +
    alpha * local`` (``alpha = 0`` discards its ``tau`` local steps). Here the
    mean is taken at the send step and held in the state (``state.held``) until
    it is applied: the arithmetic and the bytes are streaming's, but the
    transfer is not overlapped with the ``tau`` steps. ``overlap=True`` (one
    device per process, islands across processes) starts it instead at the
    send step through the native target and takes the result ``tau`` steps later:
    the transfer runs while those steps compute (the state then holds a handle,
    valid in this process only: see :func:`jaxsync.local.in_flight`).

    Args:
      inner: the whole inner optimizer, e.g. ``optax.chain(mean, adam)``.
      outer: the outer optimizer, applied to the averaged pseudo-gradient
        (default DiLoCo's: ``optax.sgd(0.7, momentum=0.9, nesterov=True)``).
      every: ``H``, the inner steps between two outer steps of a fragment.
      islands: a :class:`jaxsync.Islands`, or what :func:`jaxsync.islands`
        takes (``None``: one island per host).
      strategy: the outer mean's jaxsync strategy (``"hierarchical"``, ...).
      comm_dtype: the outer mean's wire dtype (``None`` or a 16-bit float).
      timeout: the outer mean's stall watchdog (MPI), as for the strategies.
      reset_inner: re-initialise the inner state after each outer step.
      fragments: ``P`` (``every`` must be a multiple of it).
      labels: each leaf's fragment (``None``: strided).
      mix: ``alpha`` in ``[0, 1]``.
      delay: ``tau < every / fragments``.
      overlap: run the delayed mean during the ``tau`` steps (see above).
      slice_anchor: keep the anchor and the outer state sliced over the
        island's replicas (each holds ``1/R`` of them, as ``jaxsync.sharded``
        slices its state; the new anchor is all-gathered inside the island at
        an outer step). Islands as a mesh axis, or one device per process.

    Returns:
      an ``optax.GradientTransformation`` whose state is a
      :class:`jaxsync.LocalUpdatesState`; ``update`` needs ``params``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxsync
      >>> isl = jaxsync.islands("process", comm=None)  # one process: one island
      >>> tx = jaxsync.diloco(optax.sgd(0.5), optax.sgd(1.0), every=2, islands=isl)
      >>> p = {"w": jnp.array([4.0])}
      >>> s = tx.init(p)
      >>> for _ in range(2):
      ...     u, s = tx.update({"w": jnp.array([1.0])}, s, p)
      ...     p = optax.apply_updates(p, u)
      >>> p["w"], s.anchor["w"]
      (Array([3.], dtype=float32), Array([3.], dtype=float32))
    """
    cfg = make_local_config(
        "diloco",
        inner,
        outer=outer,
        every=every,
        islands_=islands,
        strategy=strategy,
        comm_dtype=comm_dtype,
        timeout=timeout,
        reset_inner=reset_inner,
        fragments=fragments,
        labels=labels,
        mix=mix,
        delay=delay,
        overlap=overlap,
        slice_anchor=slice_anchor,
    )
    return optax.GradientTransformation(init_fn(cfg), update_fn(cfg))

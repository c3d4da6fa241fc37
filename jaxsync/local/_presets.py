"""Presets of the local-update family with their references' defaults:
``local_sgd`` (parameter averaging; post-local SGD's warm-up) and ``bmuf``
(blockwise model-update filtering, Caffe2's ``Parallelize_BMUF``).

May import: ``_state`` (the checks), ``_update`` (init and update),
``_islands``; JAX, optax.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ._islands import Islands
from ._state import make_local_config
from ._update import init_fn, update_fn


def local_sgd(
    inner: optax.GradientTransformation,
    every: int,
    warmup: int = 0,
    *,
    islands: Any = None,
    strategy: str = "hierarchical",
    comm_dtype: Any = None,
    timeout: float | None = None,
    slice_anchor: bool = False,
) -> optax.GradientTransformation:
    """Local SGD: the islands' parameters averaged every ``every`` steps.

    Each island steps alone; every ``every`` local steps the parameters are
    replaced by their mean over the islands (:func:`jaxsync.diloco` with outer
    ``optax.sgd(1.0)``: anchor - (anchor - mean) = mean). ``warmup`` is
    post-local SGD (Lin et al., "Don't use large mini-batches, use local SGD",
    ICLR 2020; PyTorch's ``PostLocalSGDOptimizer``): the first ``warmup`` steps
    are synchronous data parallel, the *gradients* averaged over every island
    before ``inner`` (not parameters averaged with ``every=1``, which differs
    under Adam); local steps start after them, the first average ``every``
    steps later.

    Args:
      inner: the whole inner optimizer (its mean over ``isl.axis_name``,
        ``isl.comm`` only).
      every: the local steps between two averages.
      warmup: synchronous data-parallel steps first (0: none).
      islands: as for :func:`jaxsync.diloco`.
      strategy: the average's jaxsync strategy.
      comm_dtype: its wire dtype.
      timeout: its stall watchdog (MPI).
      slice_anchor: keep the anchor and the outer state sliced over the
        island's replicas (each holds ``1/R`` of them, as ``jaxsync.sharded``
        slices its state; the new anchor is all-gathered inside the island at
        an outer step). Islands as a mesh axis, or one device per process.

    Returns:
      an ``optax.GradientTransformation`` (state :class:`jaxsync.LocalUpdatesState`).

    Example:
      >>> import jax.numpy as jnp, optax, jaxsync
      >>> tx = jaxsync.local_sgd(optax.sgd(1.0), every=4, warmup=2,
      ...                        islands=jaxsync.islands(comm=None))
      >>> s = tx.init({"w": jnp.zeros(2)})
      >>> int(s.step), s.anchor["w"].dtype
      (0, dtype('float32'))
    """
    cfg = make_local_config(
        "local_sgd",
        inner,
        outer=optax.sgd(1.0),
        every=every,
        islands_=islands,
        strategy=strategy,
        comm_dtype=comm_dtype,
        timeout=timeout,
        warmup=warmup,
        slice_anchor=slice_anchor,
    )
    return optax.GradientTransformation(init_fn(cfg), update_fn(cfg))


class BMUFState(NamedTuple):
    """The block-level state of :func:`jaxsync.bmuf`'s outer step.

    Attributes:
      v: the block momentum ``v`` (float32, like the anchor).
      global_params: Nesterov form only: ``theta_g`` (the anchor is then the
        point the islands restart from, ``theta_g + eta * v``); else ``()``.
    """

    v: Any
    global_params: Any


def bmuf_outer(
    block_lr: float, block_momentum: Any, nesterov: bool, isl: Islands
) -> optax.GradientTransformation:
    """BMUF's block update as an outer optimizer of the pseudo-gradient
    ``anchor - avg``: ``v <- eta * v + zeta * (avg - theta_g)``, ``theta_g <-
    theta_g + v`` (``eta = block_momentum``, ``zeta = block_lr``); Nesterov:
    the islands restart from ``theta_g + eta * v`` (Chen and Huo, 2016)."""

    def eta():
        if block_momentum is None:
            return 1.0 - 1.0 / isl.size()
        return block_momentum

    def init(anchor):
        v = jax.tree.map(jnp.zeros_like, anchor)
        # a copy: the state's anchor is another leaf of the same state (donated once)
        return BMUFState(v, jax.tree.map(jnp.copy, anchor) if nesterov else ())

    def update(pg, state, anchor=None):
        assert anchor is not None
        e = jnp.float32(eta())
        z = jnp.float32(block_lr)
        if not nesterov:  # theta_g is the anchor: avg - theta_g = -pg
            v = jax.tree.map(lambda v, g: e * v + z * (-g), state.v, pg)
            return v, BMUFState(v, ())
        g = jax.tree.map(lambda a, p, w: (a - p) - w, anchor, pg, state.global_params)
        v = jax.tree.map(lambda v, g: e * v + z * g, state.v, g)
        w = jax.tree.map(lambda w, v: w + v, state.global_params, v)
        restart = jax.tree.map(lambda w, v: w + e * v, w, v)
        return jax.tree.map(lambda r, a: r - a, restart, anchor), BMUFState(v, w)

    return optax.GradientTransformation(init, update)


def bmuf(
    inner: optax.GradientTransformation,
    every: int,
    block_lr: float = 1.0,
    block_momentum: float | None = None,
    *,
    nesterov: bool = False,
    reset_momentum_sgd: bool = False,
    warmup: int = 0,
    islands: Any = None,
    strategy: str = "hierarchical",
    comm_dtype: Any = None,
    timeout: float | None = None,
    slice_anchor: bool = False,
) -> optax.GradientTransformation:
    """BMUF: blockwise model-update filtering (Chen and Huo, ICASSP 2016).

    Caffe2's ``data_parallel_model.Parallelize_BMUF`` (this library's origin)
    with its defaults: each island runs ``inner`` for ``every`` steps (a
    block); then, with ``avg`` the islands' mean parameters and ``theta_g`` the
    global parameters, ``v <- eta * v + zeta * (avg - theta_g)`` and ``theta_g
    <- theta_g + v`` (``eta = block_momentum``, ``zeta = block_lr``), and every
    island restarts from ``theta_g``. ``block_momentum=None`` is ``1 - 1/N``
    with ``N`` islands (the paper's rule). ``nesterov=True``: the islands
    restart from ``theta_g + eta * v`` (the paper's Nesterov block momentum).
    ``reset_momentum_sgd=True`` re-initialises the inner optimizer's state
    (Caffe2: the SGD momentum) after every block. ``warmup=W`` runs the first
    ``W`` steps synchronous data parallel, as :func:`jaxsync.local_sgd`'s warm-up
    (the gradients averaged over every island before ``inner``); the anchor
    follows the parameters, and the first block ends ``every`` steps later.

    Args:
      inner: the whole inner optimizer (its mean inside the island).
      every: the block length in steps.
      block_lr: ``zeta``.
      block_momentum: ``eta`` in ``[0, 1)``, or ``None`` (``1 - 1/N``).
      nesterov: the Nesterov form.
      reset_momentum_sgd: reset the inner state after each block.
      warmup: synchronous data-parallel steps first (0: none).
      islands: as for :func:`jaxsync.diloco`.
      strategy: the block average's jaxsync strategy.
      comm_dtype: its wire dtype.
      timeout: its stall watchdog (MPI).
      slice_anchor: keep the anchor and the outer state sliced over the
        island's replicas (each holds ``1/R`` of them, as ``jaxsync.sharded``
        slices its state; the new anchor is all-gathered inside the island at
        an outer step). Islands as a mesh axis, or one device per process.

    Returns:
      an ``optax.GradientTransformation`` (state :class:`jaxsync.LocalUpdatesState`,
      its ``outer_state`` a tuple of one :class:`jaxsync.BMUFState`).

    Example:
      >>> import jax.numpy as jnp, optax, jaxsync
      >>> tx = jaxsync.bmuf(optax.sgd(0.1), every=8, islands=jaxsync.islands(comm=None))
      >>> tx.init({"w": jnp.zeros(2)}).outer_state[0].v[0]
      Array([0., 0.], dtype=float32)
    """
    for name, x in (("block_lr", block_lr), ("block_momentum", block_momentum)):
        if x is None and name == "block_momentum":
            continue
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise TypeError(
                f"bmuf got unexpected type for argument {name!r} (expected: a Python "
                f"float, got: {type(x).__name__} {x!r}). Fix: e.g. {name}=0.9."
            )
    if block_momentum is not None and not 0.0 <= block_momentum < 1.0:
        raise ValueError(
            f"bmuf: block_momentum must be in [0, 1) or None, got {block_momentum}. "
            "Fix: block_momentum=None (1 - 1/islands) or e.g. 0.875."
        )
    if not block_lr > 0.0:
        raise ValueError(f"bmuf: block_lr must be > 0, got {block_lr}. Fix: block_lr=1.0.")
    if not isinstance(nesterov, bool) or not isinstance(reset_momentum_sgd, bool):
        raise TypeError("bmuf: nesterov and reset_momentum_sgd must be bools. Fix: True/False.")
    cfg = make_local_config(
        "bmuf",
        inner,
        outer=optax.identity(),  # replaced below, once the islands are known
        every=every,
        islands_=islands,
        strategy=strategy,
        comm_dtype=comm_dtype,
        timeout=timeout,
        reset_inner=reset_momentum_sgd,
        warmup=warmup,
    )
    outer = bmuf_outer(float(block_lr), block_momentum, nesterov, cfg.islands)
    cfg = make_local_config(
        "bmuf",
        inner,
        outer=outer,
        every=every,
        islands_=cfg.islands,
        strategy=strategy,
        comm_dtype=comm_dtype,
        timeout=timeout,
        reset_inner=reset_momentum_sgd,
        warmup=warmup,
        slice_anchor=slice_anchor,
    )
    return optax.GradientTransformation(init_fn(cfg), update_fn(cfg))

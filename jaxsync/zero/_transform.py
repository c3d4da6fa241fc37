"""``jaxsync.sharded``: the optimizer state sharded over the replicas (ZeRO).

The factory validates its options when called; ``init`` slices the
parameters and makes the inner state of this replica's slices; ``update``
reduce-scatters the gradients, checks (once, when traced) that the inner
optimizer is elementwise, runs it on the slices and all-gathers the updates.

Imports: the core's config and sync (the mean's factors), ``_quantsum`` (a
quantized wire's dtypes), ``_layout``, ``_elementwise``, ``_sharded``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxsync._core import _join, _quantsum, _sync
from jaxsync._core._config import (
    AUTO,
    AxisName,
    Comm,
    check_count,
    check_transformation,
    make_config,
)
from jaxsync._core._options import ShardedKeywords, SyncOptions, merge, takes

from . import _accumulate, _elementwise, _sharded
from ._layout import Layout, make_layout
from ._sharded import ShardedState

if TYPE_CHECKING:
    from typing_extensions import Unpack


@takes(ShardedKeywords)
def sharded(
    inner: optax.GradientTransformation,
    *,
    axis_name: AxisName,
    comm: Comm = AUTO,
    options: SyncOptions | None = None,
    accumulate: int = 1,
    **overrides: Unpack[ShardedKeywords],
) -> optax.GradientTransformation:
    """Synchronise gradients and run ``inner`` on a 1/N slice of them (ZeRO).

    Takes the place of ``optax.chain(jaxsync.hierarchical_mean(...), inner)``:
    the same updates, with the optimizer's state and compute per replica cut to
    ``1/N`` of the whole (N replicas: devices x processes). The gradients are
    reduce-scattered so that each replica holds the mean of a 1/N slice of
    every leaf, ``inner`` updates that slice (a tree of the same structure,
    with the matching slices of ``params``), and the updates are all-gathered:
    the bytes on the wire are those of one allreduce.

    ``inner`` must be elementwise: ``sgd`` (momentum, nesterov), ``adam``,
    ``adamw``, ``lion``, ``rmsprop``, ``adagrad``, ``add_decayed_weights``,
    schedules, ``inject_hyperparams``, ``masked`` and ``multi_transform`` are;
    clip with :func:`jaxsync.clip_by_global_norm`. Anything that reads across a
    leaf (``optax.clip_by_global_norm``, LAMB/LARS trust ratios, adafactor) is
    refused when the step is traced, with its name and the way out. A mask or
    label function sees the slices: ``ndim`` and ``dtype`` are the leaf's, the
    shape is not (give such masks as trees).

    Args:
      inner: the optimizer to run on the slices (an optax transformation).
      axis_name: the local mesh axis (or axes) of the step, as for
        :func:`jaxsync.hierarchical_mean`; None under plain ``jit`` with one
        device per process.
      comm: as for :func:`jaxsync.mean` (an mpi4py communicator,
        ``"auto"``, a :class:`jaxsync.AxisComm`, or None: one process).
      options, **overrides: as for :func:`jaxsync.mean`: ``sharded``
        takes ``reduce``, ``comm_dtype``, ``predivide``, ``check_finite``,
        ``staging``, ``timeout``, ``on_timeout``, ``weights`` and
        ``early_termination``. Here ``comm_dtype`` is the dtype the gradients'
        reduce-scatter travels in (16-bit data summed in float32), or a
        :class:`jaxsync.Quantized` format (across processes each replica's rows
        travel as block-quantized codes, all-to-all'd and summed in float32 by
        their owner; error feedback's residuals in the state); the updates are
        gathered in their own dtype. ``check_finite``'s ``all_finite`` covers
        every replica's slice. A replica whose weight is 0 still updates its
        slice; the weights' sums travel in one small allreduce.
      accumulate: micro-steps per update (ZeRO-2's accumulation, an int >= 1):
        every call reduce-scatters its gradients into this replica's ``1/N``
        accumulator; every ``accumulate``-th runs ``inner`` once on the
        accumulated mean and all-gathers the updates; the calls between return
        zeros and gather nothing. Memory: ``1/N`` of a gradient, where
        ``optax.MultiSteps(sharded(...), k)`` holds a whole one and gathers
        every call (see docs/accumulation.md). Its state keeps the
        accumulator beside the inner state (``ShardedState.inner`` is then
        ``(inner, acc, mini_step)``): ``gather_state`` and ``shard_state``
        take ``accumulate=1`` states only.
    Returns:
      an optax ``GradientTransformation`` whose state is a
      :class:`jaxsync.ShardedState`; lay it out under ``shard_map`` with
      :func:`jaxsync.state_specs`.

    Raises:
      TypeError: ``inner`` is not an optax transformation, or an option has the
        wrong type.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxsync
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
      >>> tx = jaxsync.sharded(optax.sgd(0.1, momentum=0.9), axis_name="d", comm=None)
      >>> params = {"w": jnp.ones((3, 2))}
      >>> shapes = jax.eval_shape(tx.init, params)  # outside: for the specs
      >>> specs = jaxsync.state_specs(shapes, "d")
      >>> init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(),
      ...                              out_specs=specs))
      >>> state = init(params)
      >>> state.inner[0].trace["w"].shape  # 4 replicas' (1, 2) slices, stacked
      (4, 2)
      >>> def step(g, state, params):
      ...     u, state = tx.update(g, state, params)
      ...     return optax.apply_updates(params, u), state
      >>> run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("d"), specs, P()),
      ...                             out_specs=(P(), specs)))
      >>> g = {"w": jnp.arange(24.0).reshape(12, 2)}  # 4 replicas x (3, 2)
      >>> params, state = run(g, state, params)
      >>> bool(jnp.allclose(params["w"][0], jnp.array([0.1, 0.0])))  # 1 - 0.1 x 9, 10
      True
    """
    fn = "sharded"
    kw = merge(fn, options, overrides, takes=sharded.takes)  # type: ignore[attr-defined]
    weights, early_termination = kw.pop("weights"), kw.pop("early_termination")
    check_count(
        fn,
        "accumulate",
        accumulate,
        "micro-steps per update",
        "jaxsync.sharded(inner, axis_name=..., accumulate=4)",
    )
    check_transformation(fn, "inner", inner, "jaxsync.sharded(optax.adam(1e-3), axis_name=...)")
    cfg = make_config(
        fn,
        "two_dimensional",
        axis_name,
        comm,
        **kw,
        host_tier=False,
        overlap=False,  # one reduce-scatter and one all-gather, in the step's order
    )
    sums = dataclasses.replace(
        cfg,
        strategy="hierarchical",
        reduce="sum",
        comm_dtype=None,
        predivide=None,
        check_finite=False,
        quant=None,
    )  # fmt: skip (the small sums exact: the norm, the finite check, the weights)
    inner = optax.with_extra_args_support(inner)  # value=... reaches reduce_on_plateau
    _join.check_early_termination(fn, early_termination, weights)
    if weights is not False:  # per-replica weights and the join (jaxsync._core._join)
        fns = lambda c: _fns(fn, inner, c, sums, accumulate)
        allsum = lambda x: _sharded.allsum(sums, x)
        return _join.transform(fn, cfg, weights, fns, allsum, early_termination)
    return optax.GradientTransformationExtraArgs(*_fns(fn, inner, cfg, sums, accumulate))


def _fns(fn, inner, cfg, sums, every=1):
    # the state's maker: inner's own, or with the accumulator's slices around it
    holder = inner if every == 1 else _accumulate.wrapped_init(inner, every)

    def layout_of(tree, strict=True) -> tuple[Layout, _sharded.Place]:
        place = _sharded.Place(cfg, strict)
        return make_layout(tree, place.devices, place.processes, fn), place

    def init_fn(params):
        layout, place = layout_of(params, strict=False)
        slices = layout.take(jax.tree.leaves(params), place.index)
        state = holder.init(layout.tree(slices))
        flags = _sharded.per_replica_flags(holder, layout)
        finite = jnp.array(True) if cfg.check_finite else None
        if cfg.quant is None:
            return ShardedState(state, finite, flags)
        res = None
        if cfg.quant.error_feedback:
            res = tuple(jnp.zeros((m,), jnp.float32) for m in _quantized(layout, cfg))
        return ShardedState(state, finite, flags, res, jnp.zeros((), jnp.int32))

    def update_fn(updates, state, params=None, **extra_args):
        layout, place = layout_of(updates)
        _check_state(fn, holder, layout, state)
        n = layout.replicas
        # The gradients: cast, scaled (as the other strategies), packed by slice.
        travel = {dt: _travel(cfg, dt) for dt in layout.groups()}
        pres = {dt: _sync._predivide(cfg, t, n) for dt, t in travel.items()}
        grads = jax.tree.leaves(_sharded.share(updates, cfg))
        leaves = [
            _sync._scale_before(x.astype(travel[s.dtype]), pres[s.dtype])
            for x, s in zip(grads, layout.slots)
        ]
        bufs = layout.leaf_rows(leaves) if place.alone else layout.pack_rows(leaves)
        # accumulate=k: when the all-gather runs (ranks with another k would pair
        # it with their next reduce-scatter: a hang)
        agreed = f"{layout.describe()}\n{cfg.describe(accumulate=every)}\nsharded"
        bufs = cfg.backend.agree(agreed, "gradient tree", bufs)
        residual, step = state.residual, state.step
        if cfg.quant is not None:  # restored by shard_state: no residuals, no step
            step = jnp.zeros((), jnp.int32) if step is None else step
            residual = _residual(fn, cfg, layout, residual)
            bufs, residual = _sharded.scatter_quant(
                place.intra, cfg.backend, bufs, cfg.quant, residual, step, place.index
            )
            step = step + 1
        elif place.alone:
            bufs = _sharded.scatter_leaves(place.intra, cfg.backend, bufs)
        else:
            bufs = _sharded.scatter(place.intra, cfg.backend, bufs)

        def finish(i, piece):
            s = layout.slots[i]
            pre = pres[s.dtype]
            post = (n / pre) if cfg.reduce == "mean" else (1.0 / pre)
            if post != 1.0:
                wide = jnp.float32 if str(piece.dtype) in _sharded._LOW else piece.dtype
                piece = piece.astype(wide) / jnp.asarray(post, wide)
            return _join.divide(piece, _join.DIVISOR.get()).astype(s.dtype)

        g_slices = layout.split_leaves(bufs, finish) if place.alone else layout.split(bufs, finish)
        finite = state.all_finite
        if cfg.check_finite:
            finite = _finite(fn, cfg, sums, layout, g_slices)
        p_tree = None
        if params is not None:
            p_tree = layout.tree(layout.take(jax.tree.leaves(params), place.index))
        g_tree = layout.tree(g_slices)
        inner_state = state.inner if every == 1 else state.inner.inner
        sliced = [
            *(True for _ in g_slices),
            *state.per_replica[: len(jax.tree.leaves(inner_state))],
        ]
        sliced += [True] * len(jax.tree.leaves(p_tree))
        sliced += [False] * len(jax.tree.leaves(extra_args))
        _elementwise.check(
            lambda g, s, p, x: inner.update(g, s, p, **x),
            jax.eval_shape(lambda *a: a, g_tree, inner_state, p_tree, extra_args),
            fn,
            sliced,
        )
        allsum = lambda x: _sharded.allsum(sums, x)

        def apply(g_tree, inner_state):  # the inner update and the all-gather
            with _elementwise.sharded_context(allsum):
                u_tree, inner_state = inner.update(g_tree, inner_state, p_tree, **extra_args)
            u_slices = _updates(fn, layout, u_tree)
            ulayout = dataclasses.replace(
                layout,
                slots=tuple(
                    dataclasses.replace(s, dtype=str(u.dtype))
                    for s, u in zip(layout.slots, u_slices)
                ),
            )
            if place.alone:  # no packing: the slices as they are, few calls (buckets)
                flat = [u.reshape(-1) for u in u_slices]
                bufs = _sharded.gather_leaves(place.intra, cfg.backend, flat, cfg.bucket_bytes)
                return layout.tree(ulayout.unleaf_rows(bufs)), inner_state
            bufs = _sharded.gather(place.intra, cfg.backend, ulayout.join(u_slices))
            return layout.tree(ulayout.unpack_rows(bufs)), inner_state

        if every == 1:
            full, inner_state = apply(g_tree, inner_state)
        else:  # ZeRO-2: into the 1/N accumulator; the update every k-th call
            full, inner_state = _accumulate.step(every, state.inner, g_tree, apply)
        new = ShardedState(inner_state, finite, state.per_replica, residual, step)
        return full, new

    return init_fn, update_fn


def _travel(cfg, dt):
    """The dtype a group of ``dt`` leaves is reduce-scattered in."""
    if cfg.quant is not None:  # floating groups quantized from float32
        return _quantsum.travel(dt)
    return jnp.dtype(cfg.comm_dtype or dt)


def _quantized(layout: Layout, cfg) -> list:
    """Lengths of the quantized buffers' rows per replica (``processes x K``):
    the packed groups that travel as float32, in group order (empty ones left out)."""
    out = []
    for dt, idx in layout.groups().items():
        k = sum(layout.slots[i].k for i in idx)
        if k and _travel(cfg, dt) == jnp.float32:
            out.append(layout.processes * k)
    return out


def _residual(fn, cfg, layout: Layout, residual):
    """The state's residuals, checked against this tree's quantized buffers
    (None: zeros, e.g. a state restored by ``shard_state``)."""
    if not cfg.quant.error_feedback:
        return None
    want = _quantized(layout, cfg)
    if residual is None:
        return tuple(jnp.zeros((m,), jnp.float32) for m in want)
    got = [tuple(r.shape) for r in residual]
    if got != [(m,) for m in want]:
        raise ValueError(
            f"{fn}: the state's residuals have shapes {got}, and this gradient tree's "
            f"quantized buffers over {layout.replicas} replicas need "
            f"{[(m,) for m in want]}. Fix: make the state with this transform's init "
            "inside the map, on parameters of the same tree."
        )
    return tuple(residual)


def _check_state(fn, inner, layout: Layout, state) -> None:
    if not isinstance(state, ShardedState):
        raise TypeError(
            f"{fn}: update got a state of type {type(state).__name__}, expected "
            "ShardedState from this transform's init. Fix: pass the state that "
            "tx.init (or the previous tx.update) returned."
        )
    n = layout.replicas
    want = jax.eval_shape(inner.init, layout.tree(layout.slice_structs()))
    want_flat, want_def = jax.tree_util.tree_flatten_with_path(want)
    got, got_def = jax.tree.flatten(state.inner)
    if str(got_def) != str(want_def):
        raise ValueError(
            f"{fn}: the state's inner structure is {got_def}, and the inner optimizer's "
            f"for this gradient tree is {want_def}: a state made for another tree or "
            "another optimizer. Fix: make it with this transform's init on these "
            "parameters."
        )
    for (path, w), g in zip(want_flat, got):
        shape = tuple(w.shape)
        if tuple(g.shape) != shape:
            raise ValueError(
                f"{fn}: the state leaf {jax.tree_util.keystr(path)} has shape "
                f"{tuple(g.shape)}, expected {shape}: this replica's slice for {n} "
                f"replicas ({layout.devices} devices x {layout.processes} processes). "
                "The state was made for another tree or world size (or by init "
                "outside the map, which places one device per process). Fix: make it "
                "with this transform's init inside the map, or re-shard a saved one: "
                "jaxsync.shard_state(inner, jaxsync.gather_state(inner, states, "
                f"params), params, replicas={n}, ...)."
            )


def _updates(fn, layout: Layout, u_tree) -> list:
    leaves = jax.tree.leaves(u_tree)
    if len(leaves) != len(layout.slots):
        raise ValueError(
            f"{fn}: the inner optimizer returned {len(leaves)} update leaves for "
            f"{len(layout.slots)} gradient leaves; it must keep the tree's structure."
        )
    for u, s in zip(leaves, layout.slots):
        if tuple(u.shape) != s.slice_shape:
            raise ValueError(
                f"{fn}: the inner optimizer's update of {s.path} has shape "
                f"{tuple(u.shape)}, expected the slice's {s.slice_shape}: it must be "
                "elementwise (keep each leaf's shape)."
            )
    return leaves


def _finite(fn, cfg, sums, layout: Layout, slices):
    bad = jnp.stack([jnp.sum(~jnp.isfinite(x)).astype(jnp.float32) for x in slices])
    bad = _sharded.allsum(sums, bad)
    if cfg.check_finite == "raise":
        names = [s.path for s in layout.slots]

        def check(counts):
            hit = [m for m, c in zip(names, np.asarray(counts)) if c]
            if hit:
                raise _sync.nonfinite_error(hit)

        jax.debug.callback(check, bad)
    return jnp.all(bad == 0)

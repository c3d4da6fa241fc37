"""Scaled sign compression with error feedback (EF-SignSGD): :func:`sign_mean`.

May import: ``_common`` (state, checks, layout), ``_intra`` (collectives),
``_invariance``, ``_config`` (``make_config``), ``_mpi_backend`` (which MPI
path pads for ``lax.cond``), ``_sync`` (``sync`` for the leaves that are
not compressed) and ``_join`` (``weights=``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxsync._comm import _intra, _invariance, _mpi_backend
from jaxsync._core import _config, _join, _sync
from jaxsync._core._config import AxisName, Comm
from jaxsync._core._options import CompressKeywords, SyncOptions, merge, takes

if TYPE_CHECKING:
    from typing_extensions import Unpack

from ._common import (
    SignState,
    _check_bool,
    _check_int,
    _check_state_shapes,
    _owned_residuals,
    _owner_of,
    _reject_row_sparse,
    _residual_shape,
    _sign_layout,
    _state_error,
    _tree_error,
    _wide,
)

AUTO = _config.AUTO


_SHIFTS = np.arange(7, -1, -1, dtype=np.uint8)  # bit 7 first


def pack_signs(x):
    """``x >= 0`` of a 1-D array, packed 8 per byte (uint8, most significant bit
    first; the last byte zero-padded)."""
    n = x.shape[0]
    bits = (x >= 0).astype(jnp.uint8)
    bits = jnp.pad(bits, (0, -n % 8)).reshape(-1, 8)
    return jnp.sum(bits << jnp.asarray(_SHIFTS), axis=1, dtype=jnp.uint8)


def unpack_signs(packed, n: int, dtype=jnp.float32):
    """Inverse of :func:`pack_signs` on the last axis: +1 / -1 of ``dtype``."""
    bits = (packed[..., :, None] >> jnp.asarray(_SHIFTS)) & jnp.uint8(1)
    bits = bits.reshape(*packed.shape[:-1], -1)[..., :n]
    return bits.astype(dtype) * jnp.asarray(2, dtype) - jnp.asarray(1, dtype)


def _gather_bytes(buf, cfg, text):
    """All-gather one uint8 buffer over every replica: ``(replicas, len)``.

    Over the local axes (an XLA all-gather), then across processes (the
    backend's all-gather, by local device 0, broadcast back); the row of
    replica ``d`` of process ``p`` is ``p * local + d``.
    """
    _intra.check_axes(cfg.axes)
    _sync._check_unsynced_devices(cfg)
    intra = _intra.AxisOps(cfg.axes)
    if intra.size == 1 and getattr(cfg.backend, "native", False):
        intra = _intra.AxisOps((), unit_axes=cfg.axes)
    (buf,) = cfg.backend.agree(text, "gradient tree", [buf])
    local = intra.allgather(buf)  # (D, L)
    flat = local.reshape(-1)

    n = flat.shape[0]
    if isinstance(cfg.backend, _mpi_backend.MPIBackend) and not cfg.backend.native:
        # Host staging and mpi4jax choose the leader with lax.cond, whose branches
        # must keep shapes: the input is padded to the gathered size (as the
        # sparse sync does).
        flat = jnp.pad(flat, (0, (cfg.backend.size() - 1) * n))

    def gather(ops, bufs):
        return [ops.allgather(bufs[0][:n]).reshape(-1)]

    (world,) = cfg.backend.run(gather, [flat], intra, leader_only=True)  # (P * D*L,)
    return world.reshape(-1, buf.shape[0])


@takes(CompressKeywords)
def sign_mean(
    axis_name: AxisName,
    comm: Comm = AUTO,
    *,
    error_feedback: bool = True,
    min_size: int = 256,
    options: SyncOptions | None = None,
    **overrides: Unpack[CompressKeywords],
) -> optax.GradientTransformation:
    """Average gradients as scaled signs, 1 bit per value, with error feedback.

    Per replica and compressed leaf (``p`` = gradient + residual, ``d`` values):
    the scale ``s = sum(|p|) / d`` and the signs of ``p`` (``p >= 0``: +1) travel,
    the signs packed 8 per byte; the residual ``p - s sign(p)`` is kept for the
    next step (EF-SignSGD). The bytes of every compressed leaf and the float32
    scales form one uint8 buffer per replica, all-gathered over the local axes
    (XLA) and across processes (the backend's all-gather); every replica then
    unpacks all of them and computes ``mean_j s_j sign(p_j)`` in the same order,
    so every replica gets the same bits. Floating leaves with fewer than
    ``min_size`` values, and non-float leaves, are averaged exactly as by
    :func:`jaxsync.hierarchical_mean`.

    On the wire each replica contributes ``d / 8`` bytes per leaf instead of
    ``4 d``, but an all-gather's traffic grows with the number of replicas: a
    ring all-gather receives ``(N - 1) d / 8`` bytes against ``2 (N - 1) / N 4 d``
    for a ring allreduce, so it saves bytes for fewer than 64 replicas.

    The state (:class:`SignState`) holds this replica's residuals: checkpoint
    it with the optimizer state; under ``shard_map`` pass it with
    :func:`jaxsync.state_specs`.

    Args:
      axis_name: as for :func:`jaxsync.mean`; ``update`` runs where it is bound
        (with ``None``, anywhere: under plain ``jit`` only ``comm`` averages).
      comm: the inter-process stage, as for :func:`jaxsync.mean`.
      error_feedback: keep the compression error and add it to the next
        gradient (``False``: plain scaled sign; the residual stays zero).
      min_size: compress floating leaves of at least this many values (>= 1).
      options, **overrides: as for :func:`jaxsync.mean` (this one
        takes ``staging``, ``timeout``, ``on_timeout`` and ``weights``).

    Returns:
      an ``optax.GradientTransformation``.

    Raises:
      TypeError, ValueError: as :func:`jaxsync.powersgd_mean` raises them (a bad
        static argument when the factory is called; a state for another tree, or
        outside ``shard_map``'s per-device specs, when ``update`` is traced).

    Example:
      >>> import jax, jax.numpy as jnp, jaxsync
      >>> tx = jaxsync.sign_mean(axis_name="i", comm=None, min_size=1)
      >>> g = {"w": jnp.array([[1.0, -3.0], [3.0, -1.0]])}   # 2 replicas
      >>> state = jax.vmap(tx.init)(g)
      >>> out, state = jax.vmap(tx.update, axis_name="i")(g, state)
      >>> out["w"]                # each replica sends 2 * sign: the mean is exact
      Array([[ 2., -2.],
             [ 2., -2.]], dtype=float32)
      >>> state.residual[0]      # what each replica did not send
      Array([[-1., -1.],
             [ 1.,  1.]], dtype=float32)
      >>> one = jaxsync.sign_mean(axis_name=None, comm=None, min_size=1)
      >>> w = {"w": jnp.array([1.0, -3.0])}  # one device per process, plain jit
      >>> jax.jit(one.update)(w, one.init(w))[0]["w"]
      Array([ 2., -2.], dtype=float32)
    """
    fn = "sign_mean"
    opts = merge(fn, options, overrides, takes=sign_mean.takes)  # type: ignore[attr-defined]
    weights = opts.pop("weights")
    error_feedback = _check_bool(fn, "error_feedback", error_feedback)
    min_size = _check_int(fn, "min_size", min_size, 1, "pass e.g. min_size=256")
    cfg = _config.make_config(fn, "hierarchical", axis_name, comm, **opts)
    owner = _owner_of(cfg)

    def init_fn(params):
        leaves = jax.tree_util.tree_leaves(params)
        res = tuple(
            jnp.zeros(_residual_shape(x.shape), _wide(x.dtype))
            for x, c in zip(leaves, _sign_layout(leaves, min_size))
            if c
        )
        return SignState(jnp.zeros((), jnp.int32), res, jnp.int32(owner))

    def update_fn(updates, state, params=None):
        del params
        if not isinstance(state, SignState):
            raise _state_error(fn, state, SignState)
        _reject_row_sparse(fn, updates)
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        layout = _sign_layout(leaves, min_size)
        idx = [k for k, c in enumerate(layout) if c]
        rest = [k for k, c in enumerate(layout) if not c]
        if len(idx) != len(state.residual):
            raise _tree_error(fn, "compressed leaves", len(idx), len(state.residual))
        _check_state_shapes(fn, updates, idx, state, cfg.axes)
        new_owner = jnp.full_like(state.owner, owner)
        out = list(leaves)
        if rest:
            exact, _ = _sync.sync(tuple(leaves[k] for k in rest), cfg)
            for j, k in enumerate(rest):
                out[k] = exact[j]
        if not idx:
            return jax.tree_util.tree_unflatten(treedef, out), SignState(
                state.count + 1, state.residual, new_owner
            )
        residual = _owned_residuals(state, owner)
        shared = _invariance.share_invariant(
            [leaves[k] for k in idx], cfg.axes + cfg.backend.mesh_axes
        )
        ps, scales, packed = [], [], []
        for j, g in enumerate(shared):
            p = g.astype(_wide(g.dtype)).reshape(-1)
            if error_feedback:
                p = p + residual[j].reshape(-1)
            ps.append(p)
            scales.append(jnp.mean(jnp.abs(p)).astype(jnp.float32))
            packed.append(pack_signs(p))
        scale_bytes = lax.bitcast_convert_type(jnp.stack(scales), jnp.uint8).reshape(-1)
        buf = jnp.concatenate([*packed, scale_bytes])
        sizes = [b.shape[0] for b in packed]
        text = (
            f"sign_mean leaves {[tuple(leaves[k].shape) for k in idx]} dtypes "
            f"{[str(leaves[k].dtype) for k in idx]} bytes {buf.shape[0]}\n"
            f"{cfg.describe()}"
        )
        rows = _gather_bytes(buf, cfg, text)  # (N, L)
        nrep = rows.shape[0]
        all_scales = lax.bitcast_convert_type(
            rows[:, sum(sizes) :].reshape(nrep, len(idx), 4), jnp.float32
        )  # (N, leaves)
        new_res = []
        off = 0
        for j, k in enumerate(idx):
            d = ps[j].shape[0]
            signs = unpack_signs(rows[:, off : off + sizes[j]], d)  # (N, d)
            off += sizes[j]
            mean = jnp.sum(all_scales[:, j : j + 1] * signs, axis=0) / jnp.float32(nrep)
            out[k] = mean.reshape(leaves[k].shape).astype(leaves[k].dtype)
            if error_feedback:
                s = scales[j].astype(ps[j].dtype)
                sent = jnp.where(ps[j] >= 0, s, -s)
                new_res.append((ps[j] - sent).reshape(_residual_shape(leaves[k].shape)))
            else:
                new_res.append(state.residual[j])
        return (
            jax.tree_util.tree_unflatten(treedef, out),
            SignState(state.count + 1, tuple(new_res), new_owner),
        )

    if weights is not False:  # each replica's gradients scaled by w N / W first
        return _join.prescaled(fn, cfg, weights, init_fn, update_fn)
    return optax.GradientTransformation(init_fn, update_fn)

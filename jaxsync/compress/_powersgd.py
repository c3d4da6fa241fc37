"""PowerSGD low-rank compression with error feedback: :func:`powersgd_mean`.

May import: ``_common`` (state, checks, layout), ``_phase``,
``_invariance`` (``share_invariant``), ``_config`` (``make_config``) and
``_sync`` (``sync``: the exact hierarchical path the ``P`` and ``Q`` matrices
travel by).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxsync._comm import _invariance
from jaxsync._core import _config, _sync
from jaxsync._core._config import AxisName, Comm, OnTimeout, Staging

from ._common import (
    PowerSGDState,
    _check_bool,
    _check_float,
    _check_int,
    _check_state_shapes,
    _owned_residuals,
    _owner_of,
    _powersgd_layout,
    _reject_row_sparse,
    _state_error,
    _tree_error,
    _wide,
)
from ._phase import _check_phase_backend, _select_phase

AUTO = _config.AUTO
# Gram-Schmidt: a column whose norm is below this (relative to nothing: the data
# are gradients) is left (near) zero instead of dividing by zero.
_EPS = 1e-30


def _orthogonalise(p):
    """Columns of ``p`` (n, r) orthonormalised by Gram-Schmidt, each projection
    done twice (twice is enough: a column that is nearly dependent on the
    previous ones stays orthogonal to them). Pure float arithmetic in a fixed
    order: the same input bits give the same output bits on every replica."""
    cols = []
    for k in range(p.shape[1]):
        c = p[:, k]
        for _ in range(2):
            for q in cols:
                c = c - jnp.dot(q, c, precision=lax.Precision.HIGHEST) * q
        norm = jnp.sqrt(jnp.dot(c, c, precision=lax.Precision.HIGHEST))
        cols.append(c / (norm + jnp.asarray(_EPS, c.dtype)))
    return jnp.stack(cols, axis=1)


def _mm(a, b):
    # JAX's default precision: full float32 on CPU (Precision.HIGHEST there took
    # several times longer, measured); on GPU/TPU set jax_default_matmul_precision to
    # avoid TF32/bfloat16 passes. Every replica runs the same program, so the
    # replicas agree bit for bit either way.
    return jnp.matmul(a, b)


def powersgd_mean(
    axis_name: AxisName,
    comm: Comm = AUTO,
    *,
    rank: int = 4,
    start_step: int = 0,
    min_compression_rate: float = 2.0,
    error_feedback: bool = True,
    warm_start: bool = True,
    seed: int = 0,
    staging: Staging = "device",
    timeout: float | None = None,
    on_timeout: OnTimeout = "report",
) -> optax.GradientTransformation:
    """Average gradients with PowerSGD low-rank compression and error feedback.

    Every floating leaf with at least two axes is seen as the matrix
    ``(prod(shape[:-1]), shape[-1])`` (the last axis against the rest: flax's
    ``Dense`` kernels ``(in, out)`` and ``Conv`` kernels ``(h, w, in, out)``).
    With ``r = min(rank, n, m)`` it is compressed when ``n m / (r (n + m))``
    (the bytes saved) is at least ``min_compression_rate``; every other leaf
    (biases, norms, small matrices, integer leaves) is averaged exactly as by
    :func:`jaxsync.hierarchical_mean`, packed, in the same synchronisation as
    the ``P`` matrices.

    Per compressed leaf and step (``M`` = gradient + residual):
    ``P = mean(M Q)`` over every replica, ``P`` orthonormalised (Gram-Schmidt,
    identical on every replica), ``Q = mean(M^T P)``, update ``P Q^T``, new
    residual ``M - P Q^T``, and ``Q`` is kept for the next step (warm start).
    Two synchronisations per step, both through jaxsync's hierarchical path
    (local axes, then processes). Before ``start_step`` updates it is exactly
    ``hierarchical_mean`` (and the residuals stay zero).

    The state (:class:`PowerSGDState`) holds the step count, ``Q`` and this
    replica's residuals: checkpoint it with the optimizer state. Under
    ``shard_map`` pass it with :func:`jaxsync.state_specs`.

    Args:
      axis_name: the mesh axis name, or tuple of names, of the replicas inside
        this process, bound where ``update`` runs (``shard_map``, ``pmap`` or
        ``vmap``); ``None`` when each process has a single device and no
        mapped axis (plain ``jit``: only ``comm`` averages), as for
        ``hierarchical_mean``.
      comm: the inter-process stage, as for ``hierarchical_mean``.
      rank: the rank ``r`` of the approximation (>= 1).
      start_step: updates before compression starts (exact averages until then).
      min_compression_rate: compress a leaf only when it saves at least this
        factor of bytes (>= 0; 0 compresses every matrix).
      error_feedback: add the previous residual to the gradient (``False``: the
        residual is dropped; it stays zero in the state).
      warm_start: reuse the previous step's ``Q`` (``False``: a fresh random
        ``Q`` every step, from ``seed`` and the step count).
      seed: the seed of the initial (and, without warm start, every) ``Q``;
        the same on every replica.
      staging: ``"device"`` or ``"host"``, as for ``hierarchical_mean``.
      timeout, on_timeout: the stall watchdog, as for ``hierarchical_mean``.

    Returns:
      an ``optax.GradientTransformation``; with a named ``axis_name`` its
      ``update`` runs where that axis is bound, with ``axis_name=None``
      anywhere (e.g. under plain ``jax.jit``).

    Raises:
      TypeError, ValueError: a static argument is of the wrong type or out of
        range (when the factory is called); a state made for another tree, or
        made (or passed) outside ``shard_map``'s per-device specs (when
        ``update`` is traced).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, jaxsync
      >>> tx = jaxsync.powersgd_mean(axis_name="i", comm=None, rank=2,
      ...                            min_compression_rate=0.0)
      >>> a = jnp.asarray(np.arange(12.0).reshape(6, 2))    # shared factor
      >>> b = jnp.arange(12.0).reshape(4, 3, 1) * jnp.ones((4, 3, 2))
      >>> g = {"w": jnp.einsum("nk,rmk->rnm", a, b)}       # rank 2 per replica
      >>> state = jax.vmap(tx.init)(g)
      >>> out, state = jax.vmap(tx.update, axis_name="i")(g, state)
      >>> bool(jnp.allclose(out["w"][0], g["w"].mean(0), rtol=1e-5))
      True
      >>> one = jaxsync.powersgd_mean(axis_name=None, comm=None)
      >>> w = {"w": jnp.ones((4, 3))}  # one device per process, plain jit
      >>> jax.jit(one.update)(w, one.init(w))[0]["w"].shape
      (4, 3)
    """
    fn = "powersgd_mean"
    rank = _check_int(fn, "rank", rank, 1, "pass e.g. rank=4")
    start_step = _check_int(fn, "start_step", start_step, 0, "pass e.g. start_step=0")
    min_rate = _check_float(
        fn, "min_compression_rate", min_compression_rate, 0.0, "pass e.g. min_compression_rate=2.0"
    )
    error_feedback = _check_bool(fn, "error_feedback", error_feedback)
    warm_start = _check_bool(fn, "warm_start", warm_start)
    seed = _check_int(fn, "seed", seed, 0, "pass e.g. seed=0")
    cfg = _config.make_config(
        fn, "hierarchical", axis_name, comm, staging=staging, timeout=timeout, on_timeout=on_timeout
    )
    _check_phase_backend(fn, cfg, start_step)
    owner = _owner_of(cfg)
    key = jax.random.PRNGKey(seed)

    def fresh_q(k, m, r, count=None):
        sub = jax.random.fold_in(key, k)
        if count is not None:
            sub = jax.random.fold_in(sub, count)
        return jax.random.normal(sub, (m, r), jnp.float32)

    def init_fn(params):
        leaves = jax.tree_util.tree_leaves(params)
        layout = _powersgd_layout(leaves, rank, min_rate)
        qs, res = [], []
        for k, (x, lay) in enumerate(zip(leaves, layout)):
            if lay is None:
                continue
            n, m, r = lay
            qs.append(fresh_q(k, m, r))
            res.append(jnp.zeros(x.shape, _wide(x.dtype)))
        return PowerSGDState(jnp.zeros((), jnp.int32), tuple(qs), tuple(res), jnp.int32(owner))

    def exact(args):
        updates, state = args
        synced, _ = _sync.sync(updates, cfg)
        return synced, PowerSGDState(state.count + 1, state.q, state.residual, state.owner)

    def compressed(args):
        updates, state = args
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        layout = _powersgd_layout(leaves, rank, min_rate)
        idx = [k for k, lay in enumerate(layout) if lay is not None]
        rest = [k for k, lay in enumerate(layout) if lay is None]
        # A gradient that autodiff already summed over some axes (shard_map,
        # replicated parameters) takes part once, as in hierarchical_mean.
        shared = _invariance.share_invariant(
            [leaves[k] for k in idx], cfg.axes + cfg.backend.mesh_axes
        )
        residual = _owned_residuals(state, owner)
        ms, qs = [], []
        for j, (k, g) in enumerate(zip(idx, shared)):
            n, m, r = layout[k]
            mat = g.astype(_wide(g.dtype)).reshape(n, m)
            if error_feedback:
                mat = mat + residual[j].reshape(n, m)
            ms.append(mat)
            q = state.q[j] if warm_start else fresh_q(k, m, r, state.count)
            qs.append(q.astype(mat.dtype))
        ps = [_mm(mat, q) for mat, q in zip(ms, qs)]
        # Round 1: the P matrices and every uncompressed leaf.
        (ps, exact_leaves), _ = _sync.sync((tuple(ps), tuple(leaves[k] for k in rest)), cfg)
        ps = [_orthogonalise(p) for p in ps]
        # Round 2: the Q matrices.
        qs, _ = _sync.sync(tuple(_mm(mat.T, p) for mat, p in zip(ms, ps)), cfg)
        out = list(leaves)
        new_res = []
        for j, k in enumerate(idx):
            approx = _mm(ps[j], qs[j].T)
            out[k] = approx.reshape(leaves[k].shape).astype(leaves[k].dtype)
            if error_feedback:
                new_res.append((ms[j] - approx).reshape(leaves[k].shape))
            else:
                new_res.append(state.residual[j])
        for j, k in enumerate(rest):
            out[k] = exact_leaves[j]
        new_q = tuple(q.astype(jnp.float32) for q in qs) if warm_start else state.q
        return (
            jax.tree_util.tree_unflatten(treedef, out),
            PowerSGDState(
                state.count + 1, new_q, tuple(new_res), jnp.full_like(state.owner, owner)
            ),
        )

    def update_fn(updates, state, params=None):
        del params
        if not isinstance(state, PowerSGDState):
            raise _state_error(fn, state, PowerSGDState)
        _reject_row_sparse(fn, updates)
        leaves = jax.tree_util.tree_leaves(updates)
        layout = _powersgd_layout(leaves, rank, min_rate)
        idx = [k for k, lay in enumerate(layout) if lay is not None]
        if len(idx) != len(state.residual):
            raise _tree_error(fn, "compressed leaves", len(idx), len(state.residual))
        qs = [(layout[k][1], layout[k][2]) for k in idx]
        _check_state_shapes(fn, updates, idx, state, cfg.axes, qs)
        if start_step == 0:
            return compressed((updates, state))
        return _select_phase(state.count < start_step, exact, compressed, (updates, state), cfg)

    return optax.GradientTransformation(init_fn, update_fn)

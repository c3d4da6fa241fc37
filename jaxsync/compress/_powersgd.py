"""PowerSGD low-rank compression with error feedback: :func:`powersgd_mean`.

May import: ``_common`` (state, checks, layout), ``_phase``,
``_invariance`` (``share_invariant``), ``_config`` (``make_config``),
``_sync`` (``sync``: the exact hierarchical path the ``P`` and ``Q`` matrices
travel by) and ``_join`` (``weights=``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxsync._comm import _invariance
from jaxsync._core import _config, _join, _sync
from jaxsync._core._config import AxisName, Comm
from jaxsync._core._options import CompressKeywords, SyncOptions, merge, takes

if TYPE_CHECKING:
    from typing_extensions import Unpack

from ._common import (
    MATRIX_VIEWS,
    PowerSGDState,
    _check_bool,
    _check_float,
    _check_int,
    _check_state_shapes,
    _is_float,
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


@takes(CompressKeywords)
def powersgd_mean(
    axis_name: AxisName,
    comm: Comm = AUTO,
    *,
    rank: int = 4,
    start_step: int = 0,
    min_compression_rate: float = 2.0,
    matrix_view: str | Callable[[str, tuple], str | None] = "auto",
    error_feedback: bool = True,
    warm_start: bool = True,
    seed: int = 0,
    options: SyncOptions | None = None,
    **overrides: Unpack[CompressKeywords],
) -> PowerSGDTransformation:
    """Average gradients with PowerSGD low-rank compression and error feedback.

    Every floating leaf with at least two axes is seen as a matrix
    ``(n, m) = (prod(shape[:s]), prod(shape[s:]))``; ``matrix_view`` picks the
    split ``s``. The default, ``"auto"``, takes of the last axis against the
    rest and the first against the rest the view that saves more bytes (ties
    go to the last axis): the channels-against-the-rest view in both common
    layouts, flax's ``Dense`` ``(in, out)`` and ``Conv``
    ``(h, w, in, out)`` kernels become ``(in, out)`` and ``(h w in, out)``;
    equinox's and PyTorch's ``Linear`` ``(out, in)`` and ``Conv2d``
    ``(out, in, kh, kw)`` become ``(out, in)`` and ``(out, in kh kw)``.
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

    ``tx.describe(params)`` lists which leaves are compressed, as which
    matrix, and the bytes per step against dense; ``init`` warns once when
    most of a tree's floating-point bytes would travel uncompressed.

    Args:
      axis_name: as for :func:`jaxsync.mean`; ``update`` runs where it is bound
        (with ``None``, anywhere: under plain ``jit`` only ``comm`` averages).
      comm: the inter-process stage, as for :func:`jaxsync.mean`.
      rank: the rank ``r`` of the approximation (>= 1).
      start_step: updates before compression starts (exact averages until then).
      min_compression_rate: compress a leaf only when it saves at least this
        factor of bytes (>= 0; 0 compresses every matrix).
      matrix_view: how a leaf of >= 2 axes is seen as a matrix: ``"auto"``
        (of ``"last"`` and ``"first"`` the one that saves more bytes),
        ``"last"`` (the last axis against
        the rest: ``(prod(shape[:-1]), shape[-1])``, flax's layout) or
        ``"first"`` (the first against the rest: ``(shape[0],
        prod(shape[1:]))``, PyTorch's and equinox's); or a callable
        ``(path, shape) -> "auto" | "last" | "first" | None`` choosing per leaf
        (``path`` as ``jax.tree_util.keystr`` writes it; ``None`` sends the
        leaf exactly).
      error_feedback: add the previous residual to the gradient (``False``: the
        residual is dropped; it stays zero in the state).
      warm_start: reuse the previous step's ``Q`` (``False``: a fresh random
        ``Q`` every step, from ``seed`` and the step count).
      seed: the seed of the initial (and, without warm start, every) ``Q``;
        the same on every replica.
      options, **overrides: as for :func:`jaxsync.mean` (this one
        takes ``staging``, ``timeout``, ``on_timeout`` and ``weights``).

    Returns:
      a :class:`PowerSGDTransformation` (an ``optax.GradientTransformation``
      with ``describe(params)``).

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
      >>> w = {"w": jnp.ones((64, 32)), "b": jnp.ones(32)}  # plain jit
      >>> jax.jit(one.update)(w, one.init(w))[0]["w"].shape
      (64, 32)
      >>> conv = {"w": jnp.zeros((16, 8, 3, 3))}  # equinox's (out, in, kh, kw)
      >>> print(one.describe(conv))  # doctest: +NORMALIZE_WHITESPACE
      powersgd_mean(rank=4, min_compression_rate=2.0, matrix_view='auto'): 1 of 1
      leaves compressed (100% of the floating-point bytes); 1,408 bytes per step
      instead of 4,608 (3.3x fewer)
        ['w']  (16, 8, 3, 3) float32  as (16, 72)  rank 4  compressed: 1,408 bytes
        instead of 4,608 (3.3x)
    """
    fn = "powersgd_mean"
    opts = merge(fn, options, overrides, takes=powersgd_mean.takes)  # type: ignore[attr-defined]
    weights = opts.pop("weights")
    rank = _check_int(fn, "rank", rank, 1, "pass e.g. rank=4")
    start_step = _check_int(fn, "start_step", start_step, 0, "pass e.g. start_step=0")
    min_rate = _check_float(
        fn, "min_compression_rate", min_compression_rate, 0.0, "pass e.g. min_compression_rate=2.0"
    )
    error_feedback = _check_bool(fn, "error_feedback", error_feedback)
    warm_start = _check_bool(fn, "warm_start", warm_start)
    seed = _check_int(fn, "seed", seed, 0, "pass e.g. seed=0")
    if not callable(matrix_view) and matrix_view not in MATRIX_VIEWS:
        raise ValueError(
            f"{fn}: matrix_view must be one of {MATRIX_VIEWS} or a callable (path, shape) -> "
            f"one of them or None, got {matrix_view!r}. Fix: matrix_view='auto' (the view "
            "that saves more bytes), 'last' (flax's (in, out) layout) or 'first' (equinox's and "
            "PyTorch's (out, in))."
        )
    cfg = _config.make_config(fn, "hierarchical", axis_name, comm, **opts)
    _check_phase_backend(fn, cfg, start_step)
    owner = _owner_of(cfg)
    key = jax.random.PRNGKey(seed)

    def fresh_q(k, m, r, count=None):
        sub = jax.random.fold_in(key, k)
        if count is not None:
            sub = jax.random.fold_in(sub, count)
        return jax.random.normal(sub, (m, r), jnp.float32)

    def layout_of(tree):
        with_paths = jax.tree_util.tree_flatten_with_path(tree)[0]
        leaves = [x for _, x in with_paths]
        paths = [jax.tree_util.keystr(p) for p, _ in with_paths]
        return leaves, paths, _powersgd_layout(leaves, rank, min_rate, matrix_view, paths)

    header = (
        f"{fn}(rank={rank}, min_compression_rate={min_rate}, matrix_view="
        f"{matrix_view if callable(matrix_view) else repr(matrix_view)})"
    )
    warned: set = set()

    def init_fn(params):
        leaves, paths, layout = layout_of(params)
        _warn_if_mostly_dense(fn, header, leaves, paths, layout, warned)
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
        treedef = jax.tree_util.tree_structure(updates)
        leaves, _, layout = layout_of(updates)
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

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args  # other transforms' (optax.chain passes every one to all)
        if not isinstance(state, PowerSGDState):
            raise _state_error(fn, state, PowerSGDState)
        _reject_row_sparse(fn, updates)
        leaves, _, layout = layout_of(updates)
        idx = [k for k, lay in enumerate(layout) if lay is not None]
        if len(idx) != len(state.residual):
            raise _tree_error(fn, "compressed leaves", len(idx), len(state.residual))
        qs = [(layout[k][1], layout[k][2]) for k in idx]
        _check_state_shapes(fn, updates, idx, state, cfg.axes, qs)
        if start_step == 0:
            return compressed((updates, state))
        return _select_phase(state.count < start_step, exact, compressed, (updates, state), cfg)

    def describe(params) -> str:
        leaves, paths, layout = layout_of(params)
        return _describe(header, leaves, paths, layout)

    if weights is not False:  # each replica's gradients scaled by w N / W first
        tx = _join.prescaled(fn, cfg, weights, init_fn, update_fn)
        return PowerSGDTransformation(tx.init, tx.update, describe)
    return PowerSGDTransformation(init_fn, update_fn, describe)


class PowerSGDTransformation(optax.GradientTransformationExtraArgs):
    """The ``optax.GradientTransformation`` of :func:`powersgd_mean`, with
    ``describe(params)``: which leaves of a tree are compressed, as which
    matrix, and the bytes per step against dense. (Inside ``optax.chain``
    call it on the transform itself.)"""

    __slots__ = ()

    def __new__(cls, init, update, describe):
        self = super().__new__(cls, init, update)
        update.describe = describe
        return self

    def describe(self, params) -> str:
        """The compression of ``params`` (or gradients of that structure), leaf by leaf."""
        return self.update.describe(params)


def _leaf_bytes(x, lay) -> tuple[int, int]:
    """(dense bytes, bytes sent per step) of one leaf; ``P`` and ``Q`` travel in
    the compute dtype (float32 for 16-bit leaves)."""
    dense = math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
    if lay is None:
        return dense, dense
    n, m, r = lay
    return dense, r * (n + m) * _wide(x.dtype).itemsize


def _describe(header, leaves, paths, layout) -> str:
    rows, total, sent, floats, packed = [], 0, 0, 0, 0
    for x, path, lay in zip(leaves, paths, layout):
        dense, wire = _leaf_bytes(x, lay)
        total, sent = total + dense, sent + wire
        floats += dense if _is_float(x) else 0
        packed += dense if lay is not None else 0
        what = f"{path or 'the leaf'}  {tuple(x.shape)} {jnp.dtype(x.dtype).name}"
        if lay is None:
            why = "not floating" if not _is_float(x) else "saves too little, or not a matrix"
            rows.append(f"  {what}  exact ({why}): {dense:,} bytes")
        else:
            n, m, r = lay
            rows.append(
                f"  {what}  as ({n}, {m})  rank {r}  compressed: {wire:,} bytes instead of "
                f"{dense:,} ({dense / wire:.1f}x)"
            )
    count = sum(lay is not None for lay in layout)
    share = packed / floats if floats else 0.0
    ratio = f"{total / sent:.1f}x fewer" if sent else "nothing to send"
    head = (
        f"{header}: {count} of {len(leaves)} leaves compressed ({share:.0%} of the "
        f"floating-point bytes); {sent:,} bytes per step instead of {total:,} ({ratio})"
    )
    return "\n".join([head, *rows])


def _warn_if_mostly_dense(fn, header, leaves, paths, layout, warned) -> None:
    """Once per tree: a warning when most floating-point bytes stay uncompressed."""
    floats = [(x, p, lay) for x, p, lay in zip(leaves, paths, layout) if _is_float(x)]
    total = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x, _, _ in floats)
    packed = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x, _, lay in floats if lay)
    key = tuple((p, tuple(x.shape)) for x, p, _ in floats)
    if not total or packed * 2 >= total or key in warned:
        return
    warned.add(key)
    biggest = sorted(
        ((math.prod(x.shape), p, tuple(x.shape)) for x, p, lay in floats if lay is None),
        reverse=True,
    )[:3]
    names = ", ".join(f"{p or 'the leaf'} {shape}" for _, p, shape in biggest)
    warnings.warn(
        f"{fn}: only {packed / total:.0%} of the tree's floating-point bytes are "
        f"compressed; the rest travel uncompressed (largest: {names}). {header} "
        "compresses a leaf when its matrix view saves min_compression_rate. Fix: check "
        "tx.describe(params); lower min_compression_rate "
        "or the rank, pass matrix_view= for your layout, or use hierarchical_mean if the "
        "tree has no large matrices.",
        UserWarning,
        stacklevel=3,
    )

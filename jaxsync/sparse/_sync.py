"""How :class:`RowSparse` leaves are synchronised: a hook of ``_sync.sync``.

``sync_mixed`` splits a gradient tree into its dense leaves (synchronised by the
strategy's own ``dense_sync``, with ``"dense"``-mode tables scattered into them)
and its row-sparse leaves, which are *all-gathered*: one all-gather per dtype
over the local axes and one across processes (MPI or ``AxisComm``).

May import: ``_sparse`` (the type and options), ``_intra`` (collectives),
``_invariance`` and ``_mpi_backend``. Never ``_sync`` (which imports this
module): the dense synchronisation comes in as the ``dense_sync`` argument.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsync._comm import _intra, _invariance, _mpi_backend

from ._rows import (
    RowSparse,
    SparseOptions,
    _coalesce,
    _is_rs,
    choose,
    path_str,
)


@jax.tree_util.register_pytree_node_class
class _Hole:
    """Where a sparse leaf was: an empty pytree node for the dense plan."""

    def tree_flatten(self):
        return (), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls()


def sync_mixed(tree, cfg, dense_sync: Callable):
    """Sync dense leaves with ``dense_sync(tree, cfg)`` and RowSparse leaves by gathers."""
    opts = cfg.sparse if cfg.sparse is not None else SparseOptions()
    _intra.check_axes(cfg.axes)
    intra = _intra.AxisOps(cfg.axes)
    replicas = intra.size * cfg.backend.size()
    if cfg.axes and intra.size == 1 and getattr(cfg.backend, "native", False):
        # As the dense path: no local stage; results typed invariant over the
        # size-1 local axes by the MPI call itself.
        intra = _intra.AxisOps((), unit_axes=cfg.axes)
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_rs)
    sparse_at = [i for i, (_, x) in enumerate(with_paths) if _is_rs(x)]
    paths = {i: path_str(with_paths[i][0]) for i in sparse_at}
    if cfg.reduce == "mean":
        _reject_integer_rows([(paths[i], with_paths[i][1]) for i in sparse_at])
    modes = {i: choose(opts.mode_of(paths[i]), replicas, with_paths[i][1]) for i in sparse_at}
    # Agreement first: k, num_rows, shapes, dtypes and the chosen side of every
    # sparse leaf; a mismatch fails every process with the same message.
    lines = [
        f"row-sparse leaf {paths[i]}: k {g.k} num_rows {g.num_rows} row_shape "
        f"{g.row_shape} values {g.dtype} indices {g.indices.dtype} -> {modes[i]}"
        for i in sparse_at
        for g in [with_paths[i][1]]
    ]
    lines.append(
        f"sparse options mode {opts.mode} coalesce {opts.coalesce} densify "
        f"{opts.densify} reduce {cfg.reduce} replicas per process "
        f"{intra.size if intra.axes else 1} backend {cfg.backend.name}"
    )
    flat = [x for i in sparse_at for x in (with_paths[i][1].indices, with_paths[i][1].values)]
    flat = cfg.backend.agree("\n".join(lines), "gradient tree", flat)
    leaves = [x for _, x in with_paths]
    for j, i in enumerate(sparse_at):
        leaves[i] = RowSparse.tree_unflatten(leaves[i].num_rows, flat[2 * j : 2 * j + 2])
    dense_leaves = list(leaves)
    for i in sparse_at:
        dense_leaves[i] = _Hole()
        if modes[i] == "dense":
            dense_leaves[i] = leaves[i].todense()
            if cfg.check_finite and jnp.issubdtype(leaves[i].dtype, jnp.floating):
                # An index out of range on any replica makes one element NaN, so
                # the reduced leaf (the same on every replica) fails the check.
                bad = jnp.where(jnp.all(leaves[i].valid()), 0.0, jnp.nan)
                d = dense_leaves[i]
                dense_leaves[i] = d.at[(0,) * d.ndim].add(bad.astype(d.dtype))
    dense_out, finite = dense_sync(jax.tree_util.tree_unflatten(treedef, dense_leaves), cfg)
    out = treedef.flatten_up_to(dense_out)  # type: ignore[attr-defined]
    sparse = [i for i in sparse_at if modes[i] == "sparse"]
    synced, ok = _sync_sparse([leaves[i] for i in sparse], cfg, intra, replicas, opts)
    for i, g in zip(sparse, synced):
        out[i] = g
    if cfg.check_finite and finite is not None and ok is not None:
        finite = finite & ok
        if cfg.check_finite == "raise":
            _raise_if_bad([paths[i] for i in sparse], ok)
    return jax.tree_util.tree_unflatten(treedef, out), finite


def _reject_integer_rows(named) -> None:
    """The mean of integer rows is not an integer (and gathered rows are only
    ever summed): refused at trace time rather than returning the sum."""
    for name, g in named:
        if not jnp.issubdtype(g.dtype, jnp.floating):
            raise TypeError(
                f"jaxsync: reduce='mean' got the row-sparse leaf {name!r} with {g.dtype} "
                "values (expected: floating values; the mean of integer rows is not an "
                "integer, and integer rows are never rounded). Fix: cast its values to "
                "a float dtype, jaxsync.RowSparse(g.indices, g.values.astype(jnp.float32), "
                "g.num_rows), or sum them with reduce='sum'."
            )


def _sync_sparse(gs: list, cfg, intra, replicas: int, opts: SparseOptions):
    """All-gather every RowSparse of ``gs``: one call per dtype per stage."""
    if not gs:
        return [], None
    axes = cfg.axes + cfg.backend.mesh_axes
    gs = [_share(g, axes) for g in gs]
    mean = cfg.reduce == "mean"
    scale = mean and not opts.densify
    # One buffer of int32 indices, one buffer of values per dtype.
    bufs = [_concat([g.indices for g in gs])]
    groups: dict = {}
    for j, g in enumerate(gs):
        groups.setdefault(str(g.dtype), []).append(j)
    for _dt, js in groups.items():
        bufs.append(
            _concat([_prescale(gs[j].values, replicas if scale else 1).reshape(-1) for j in js])
        )
    # (L*m,): the inter stage takes 1-D buffers (host staging ties them by
    # their first element); a reshape of a contiguous array is free.
    got = [intra.allgather(b).reshape(-1) for b in bufs]
    if isinstance(cfg.backend, _mpi_backend.MPIBackend) and not cfg.backend.native:
        # Host staging and mpi4jax choose the leader with lax.cond, whose branches
        # must keep shapes: the input is padded to the gathered size.
        procs, sizes = cfg.backend.size(), [b.shape[0] for b in got]
        got = [jnp.pad(b, (0, (procs - 1) * b.shape[0])) for b in got]
        got = cfg.backend.run(
            lambda ops, bs: [ops.allgather(b[:m]).reshape(-1) for b, m in zip(bs, sizes)],
            got,
            intra,
            leader_only=True,
        )
    else:
        got = cfg.backend.run(_gather_program, got, intra, leader_only=True)  # (P, L*m)
    got = [x.reshape(replicas, -1) for x in got]  # (R, m) rank-major
    out: list = [None] * len(gs)
    idx_all, off = got[0], 0
    indices = []
    for g in gs:
        indices.append(idx_all[:, off : off + g.k].reshape(-1))
        off += g.k
    oks = []
    for (_dt, js), vals in zip(groups.items(), got[1:]):
        off = 0
        for j in js:
            g = gs[j]
            w = g.k * int(np.prod(g.row_shape, dtype=np.int64))
            v = vals[:, off : off + w].reshape(replicas * g.k, *g.row_shape)
            off += w
            full = RowSparse.tree_unflatten(g.num_rows, (indices[j], v))
            if cfg.check_finite:
                oks.append(jnp.all(full.valid()) & jnp.all(jnp.isfinite(v)))
            if opts.densify:
                d = full.todense()
                out[j] = _postscale(d, replicas) if mean else d
            elif opts.coalesce:
                out[j] = _coalesce(full)
            else:
                out[j] = full
    ok = jnp.all(jnp.stack(oks)) if oks else None
    return out, ok


def _gather_program(ops, bufs):
    return [ops.allgather(b) for b in bufs]


def _concat(xs):
    return xs[0] if len(xs) == 1 else jnp.concatenate(xs)


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _prescale(v, n: int):
    if n == 1 or not jnp.issubdtype(v.dtype, jnp.floating):
        return v
    if _is_pow2(n):
        return v * jnp.asarray(1.0 / n, v.dtype)  # exact
    return v / jnp.asarray(n, v.dtype)


def _postscale(d, n: int):
    if n == 1:
        return d
    wide = jnp.float32 if str(d.dtype) in ("float16", "bfloat16") else d.dtype
    return (d.astype(wide) / jnp.asarray(n, wide)).astype(d.dtype)


def _share(g: RowSparse, axes):
    """As ``share_invariant``: a gradient autodiff already summed counts once."""
    if not axes:
        return g
    typed = set(_invariance._vma(lax.axis_index(axes)))
    if not typed:  # vmap, pmap or check_vma=False: no axis types
        return g
    values = _invariance.share_invariant(g.values, axes)
    values = _invariance._varying(values, tuple(a for a in axes if a in typed))
    indices = _invariance._varying(g.indices, tuple(a for a in axes if a in typed))
    return RowSparse.tree_unflatten(g.num_rows, (indices, values))


def _raise_if_bad(names, ok):
    def check(ok):
        if not bool(ok):
            raise FloatingPointError(
                "jaxsync: non-finite values, or indices outside [0, num_rows), in the "
                f"row-sparse leaves {', '.join(names[:10])} after synchronisation. "
                "Every replica sees the same rows. To skip such steps on every "
                "replica at once instead of failing: optax.chain(<the jaxsync mean>, "
                "optax.apply_if_finite(opt, n)) (the decision after the "
                "mean), or jaxsync.apply_if_finite(tx, n, axis_name=...) "
                "around a chain or jaxsync.sharded; optax.apply_if_finite "
                "around the synchronisation skips on one replica alone (a "
                "hang across processes)."
            )

    jax.debug.callback(check, ok)

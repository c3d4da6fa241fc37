"""The synchronisation itself: pack, reduce, unpack (``sync``), and the pure
function ``sync_gradients`` and the init/update pair every transform shares.

Imports: ``_config`` (a validated ``SyncConfig``), ``_plan``, ``_strategies``,
the backends, and ``_plugins`` (where ``RowSparse`` leaves and ``"auto"`` plug in).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxsync._comm import _host_tier, _intra, _invariance, _mpi_backend

from . import _options, _overlap, _plugins, _quantsum, _strategies
from ._config import (
    AUTO,
    AxisName,
    Comm,
    ProfileLike,
    SyncConfig,
    make_config,
)
from ._overlap import DoubleBufferState, overlap_groups  # noqa: F401 (re-exported)
from ._plan import REDUCED_DTYPES, make_plan

if TYPE_CHECKING:
    from typing_extensions import Unpack


PyTree = Any


def sync(tree: PyTree, cfg: SyncConfig, quant=None):
    """Reduce ``tree`` per ``cfg``; returns (tree, all_finite or None).

    ``quant``: ``(residuals, step)`` of a quantized wire's state (``_quantsum``):
    then returns (tree, all_finite or None, new residuals)."""
    kind = _plugins.tree_kind(tree)
    if kind is not None:  # RowSparse leaves: split off and all-gathered (jaxsync.sparse)
        return kind.sync(tree, cfg, sync)
    _intra.check_axes(cfg.axes)
    _plugins.check_sync(cfg)  # e.g. an inner mean that reaches past its island
    if cfg.auto is not None:  # chosen now, from the tree (jaxsync.auto)
        chosen = _plugins.strategy(cfg.strategy)
        assert chosen is not None, cfg.strategy  # its make_config made this cfg
        cfg = chosen.resolve(tree, cfg)
    _check_unsynced_devices(cfg)
    intra = _intra.AxisOps(cfg.axes)
    alone = intra.size == 1 and getattr(cfg.backend, "native", False)
    # One device per process and jaxsync's native allreduce: hierarchical,
    # two_dimensional and flat hand it the leaves as they are, and it sums the
    # small ones together itself (a memcpy into one MPI message): nothing is
    # packed or unpacked in XLA.
    # With the host tier two_dimensional reduce-scatters over the processes of
    # a host: its small leaves are packed (one slice each, not one per leaf).
    # The host tier, where the topology has one, per the host_tier option
    # (the same on every process: the option is in the agreed text).
    tiered = _host_tier.chosen(cfg.host_tier, _wire(tree, cfg.comm_dtype))
    if cfg.quant is not None:  # the host tier sends fewer bytes across hosts ("auto": on)
        tiered = _host_tier.effective(cfg.host_tier) is not False
    scatters = cfg.strategy == "two_dimensional" and tiered and _scatters_over_host(cfg.backend)
    per_leaf = cfg.strategy == "naive" or (
        alone and not scatters and cfg.strategy in ("hierarchical", "two_dimensional", "flat")
    )
    # flat's packing is then the native target's: every leaf of one dtype into
    # messages of up to bucket_bytes, through a scratch buffer it reuses.
    group = None
    if alone and cfg.strategy == "flat":
        group = cfg.bucket_bytes if cfg.bucket_bytes is not None else 2**62
    plan = make_plan(
        tree, bucket_bytes=cfg.bucket_bytes, pack_threshold=cfg.pack_threshold, per_leaf=per_leaf
    )
    if cfg.quant is not None:
        plan = _quantsum.plan_for(tree, cfg)
    agreed = f"{plan.describe()}\n{cfg.describe()}\nreplicas per process {intra.size}"
    n = intra.size * cfg.backend.size()
    if cfg.axes and alone:
        # One device per process: no local stage at all (no psum, no leader
        # choice, no broadcast); the MPI results are typed invariant over the
        # size-1 axes directly.
        intra = _intra.AxisOps((), unit_axes=cfg.axes)
    tree = _invariance.share_invariant(tree, cfg.axes + cfg.backend.mesh_axes)
    dtypes = [jnp.dtype(b.dtype) for b in plan.buckets]
    travel = [jnp.dtype(cfg.comm_dtype) if cfg.comm_dtype else dt for dt in dtypes]
    if cfg.quant is not None:  # floating buckets are quantized from float32
        travel = [_quantsum.travel(dt) for dt in travel]
    pres = [_predivide(cfg, dt, n) for dt in travel]

    def prepare(k, leaf):
        # Cast and scale each leaf before it is packed: fuses into its producer.
        return _scale_before(leaf.astype(travel[k]), pres[k])

    bufs = plan.pack(tree, prepare)
    # Checked by every process the first time the compiled step runs, before
    # any buffer travels (never while tracing: a process may trace alone).
    bufs = cfg.backend.agree(agreed, "gradient tree", bufs)
    residual = None
    if cfg.quant is not None:
        residual, step = quant if quant is not None else (None, None)
        bufs, residual = _quantsum.run(cfg, bufs, residual, intra, tiered, step)
    elif cfg.overlap or cfg.double_buffering:
        bufs = _overlap.run_async(cfg, bufs, intra, group, tiered)
    else:
        bufs = _strategies.run(cfg.strategy, bufs, intra, cfg.backend, group, tiered)
    posts = [(n / pre) if cfg.reduce == "mean" else (1.0 / pre) for pre in pres]

    def finish(k, piece):
        # The division after the sum (if any) is applied per leaf at unpack, so
        # it fuses into the slice that unpacks it: no pass over the buffer.
        if posts[k] != 1.0:
            wide = jnp.float32 if str(piece.dtype) in ("float16", "bfloat16") else piece.dtype
            piece = piece.astype(wide) / jnp.asarray(posts[k], wide)
        return piece.astype(dtypes[k])

    result = plan.unpack(bufs, tree, finish)
    finite = None
    if cfg.check_finite:
        named = _reduced_leaves(plan, result)
        flags = [jnp.all(jnp.isfinite(x)) for _, x in named]
        finite = jnp.all(jnp.stack(flags)) if flags else jnp.array(True)
        if cfg.check_finite == "raise":
            _raise_if_nonfinite(named)
    return (result, finite) if quant is None else (result, finite, residual)


def _wire(tree, comm_dtype) -> list:
    """``(itemsize, bytes)`` of each reduced leaf of ``tree`` as it travels."""
    out = []
    for x in jax.tree.leaves(tree):
        if str(x.dtype) in REDUCED_DTYPES:
            isz = jnp.dtype(comm_dtype or x.dtype).itemsize
            out.append((isz, isz * int(np.prod(x.shape))))
    return out


def _scatters_over_host(backend) -> bool:
    """Whether a ``two_dimensional`` sum reduce-scatters over a host's processes."""
    return isinstance(backend, _mpi_backend.MPIBackend) and backend.tier(False) is not None


def _check_unsynced_devices(cfg: SyncConfig) -> None:
    """Devices of a mapped axis left out of ``axis_name`` would all talk MPI.

    Inside ``shard_map``/``pmap`` every device runs the MPI stage for the axes it
    is not synchronised over, concurrently on one communicator: the messages of
    different devices would be matched with each other (wrong sums or a hang).
    ``vmap`` axes are fine (every replica is a row of one message).
    """
    if not isinstance(cfg.backend, _mpi_backend.MPIBackend):
        return
    bad = [
        a
        for a, n in _intra.bound_axes().items()
        if n > 1 and a not in cfg.axes and not _intra._is_batched(jax.lax.axis_index(a))
    ]
    if bad:
        got = "None" if not cfg.axes else repr(cfg.axes)
        want = tuple(dict.fromkeys(cfg.axes + tuple(bad)))
        raise ValueError(
            f"jaxsync: axis_name={got} but this runs inside shard_map/pmap over the "
            f"device axes {bad} (sizes {[_intra.bound_axes()[a] for a in bad]}): "
            "every device would run MPI on the same communicator and the processes' "
            "messages would be mismatched. Fix: pass the mapped axes, "
            f"axis_name={want[0] if len(want) == 1 else want!r}, or call the "
            "transform outside the multi-device map (plain jit, one device per "
            "process)."
        )


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _predivide(cfg: SyncConfig, travel_dtype, n: int) -> float:
    """The factor divided out before the sum (1.0: none)."""
    if cfg.predivide is not None:
        return cfg.predivide
    if cfg.reduce == "mean" and (_is_pow2(n) or str(travel_dtype) == "float16"):
        # A power of two is exact to divide by first (the scaled sum is the
        # scaled sum, bit for bit, away from subnormals) and fuses into the
        # pack. float16 is divided first by the largest power of two p <= n
        # (exact: dividing by n itself rounded every value) so the sum cannot
        # overflow unless the mean exceeds p / n (> 1/2) of float16's largest;
        # the rest, n / p, after the sum.
        return float(1 << (n.bit_length() - 1))
    return 1.0


def _scale_before(b, pre: float):
    if pre == 1.0:
        return b
    if _is_pow2(int(pre)) and float(int(pre)) == pre:
        return b * jnp.asarray(1.0 / pre, b.dtype)  # exact; a multiply fuses best
    return b / jnp.asarray(pre, b.dtype)


def _reduced_leaves(plan, result):
    leaves = jax.tree_util.tree_leaves(result)
    return [
        (spec.path, leaves[i]) for i, spec in enumerate(plan.leaves) if spec.reduced and spec.size
    ]


def _raise_if_nonfinite(named):
    if not named:
        return
    names = [n for n, _ in named]
    flags = jnp.stack([jnp.all(jnp.isfinite(x)) for _, x in named])

    def check(flags):
        bad = [n for n, ok in zip(names, np.asarray(flags)) if not ok]
        if bad:
            raise nonfinite_error(bad)

    jax.debug.callback(check, flags)


def nonfinite_error(bad: list) -> FloatingPointError:
    """The error for non-finite values in the reduced leaves named ``bad``."""
    return FloatingPointError(
        f"jaxsync: non-finite values after the gradient reduction in "
        f"{len(bad)} leaf/leaves: {', '.join(bad[:10])}"
        f"{' ...' if len(bad) > 10 else ''}. Every replica sees the same "
        "values. To skip such steps on every replica at once instead of "
        "failing: optax.chain(<the jaxsync mean>, "
        "optax.apply_if_finite(opt, n)) (the decision after the "
        "mean), or jaxsync.apply_if_finite(tx, n, axis_name=...) "
        "around a chain or jaxsync.sharded; optax.apply_if_finite "
        "around the synchronisation skips on one replica alone (a "
        "hang across processes)."
    )


@_options.takes(_options.SyncKeywords)
def sync_gradients(
    tree: PyTree,
    *,
    axis_name: AxisName,
    strategy: str = "hierarchical",
    comm: Comm = AUTO,
    options: _options.SyncOptions | None = None,
    profile: ProfileLike = None,
    **overrides: Unpack[_options.SyncKeywords],
) -> PyTree:
    """Reduce a gradient pytree over every replica; a pure function.

    Call it inside ``shard_map``, ``pmap`` or ``vmap(axis_name=...)``. For use in a
    training loop, prefer the optax factories, which validate options once.

    It is for gradients. Under ``shard_map`` a leaf typed invariant over the
    axes (equal on every device) is read as a gradient autodiff already summed
    over them (a parameter that entered replicated, ``in_specs=P()``), so it is
    counted once and divided by the replica count. A value that is already a
    mean, such as statistics ``lax.pmean``'d by flax's
    ``BatchNorm(axis_name=...)``, is then divided again: average non-gradient
    values (BatchNorm statistics, metrics, the loss) with
    :func:`jaxsync.replica_mean`.

    Args:
      tree: the gradients: a pytree of arrays (:class:`jaxsync.RowSparse` leaves
        too).
      axis_name: as for :func:`jaxsync.mean`.
      strategy: ``"naive"``, ``"flat"``, ``"hierarchical"``,
        ``"two_dimensional"``, ``"single_node"`` (one process: ``comm`` must be
        ``None`` or ``"auto"``), or ``"auto"``: chosen from the cost model when
        the step is traced (see :func:`jaxsync.auto_mean`).
      comm: as for :func:`jaxsync.mean`.
      options, **overrides: as for :func:`jaxsync.mean`; the options
        of a transform's state (``overlap``, ``double_buffering``, ``host_tier``,
        ``weights``, ``early_termination``) are the factories' only.
      profile: ``strategy="auto"`` only: as for :func:`jaxsync.auto_mean`.

    Returns:
      the reduced tree; with ``check_finite=True`` or ``"raise"``, a pair
      ``(tree, all_finite)`` where ``all_finite`` is a boolean scalar, the same
      on every replica. ``strategy="single_node"`` has no inter-process stage and
      accepts only ``comm=None`` or ``"auto"``.

    Example:
      >>> import jax, jax.numpy as jnp, jaxsync
      >>> g = {"w": jnp.arange(8.0)[:, None] * jnp.ones((8, 2))}
      >>> out = jax.vmap(lambda t: jaxsync.sync_gradients(
      ...     t, axis_name="i", strategy="flat", comm=None), axis_name="i")(g)
      >>> out["w"][0]
      Array([3.5, 3.5], dtype=float32)
      >>> out, ok = jax.vmap(lambda t: jaxsync.sync_gradients(
      ...     t, axis_name="i", comm=None, check_finite=True), axis_name="i")(g)
      >>> bool(ok.all())
      True
    """
    kw = _options.merge("sync_gradients", options, overrides, sync_gradients.takes)  # type: ignore[attr-defined]
    cfg = make_config("sync_gradients", strategy, axis_name, comm, profile=profile, **kw)
    _quantsum.check_stateless(cfg)
    out, finite = sync(tree, cfg)
    return (out, finite) if cfg.check_finite else out


class SyncState(NamedTuple):
    """State of a jaxsync transform made with ``check_finite=True``.

    Attributes:
      all_finite: whether the last synchronised gradients were all finite; the
        same on every replica.
    """

    all_finite: jax.Array


def transform_fns(fn: str, cfg: SyncConfig):
    """``(init_fn, update_fn)`` of a transform that synchronises with ``cfg``."""
    if cfg.double_buffering:  # a quantized wire's state inside (DoubleBufferState.wire)
        wire = _quantsum.transform_fns(fn, cfg, sync) if cfg.quant is not None else None
        return _overlap.double_buffer_fns(fn, cfg, sync, wire)
    if cfg.quant is not None:  # the residuals and the step in a QuantState
        return _quantsum.transform_fns(fn, cfg, sync)
    expected = SyncState if cfg.check_finite else optax.EmptyState

    def init_fn(params):
        del params
        if cfg.check_finite:
            return SyncState(all_finite=jnp.array(True))
        return optax.EmptyState()

    def update_fn(updates, state, params=None):
        del params
        if not isinstance(state, expected):
            raise TypeError(
                f"{fn}: update got a state of type {type(state).__name__}, expected "
                f"{expected.__name__} from this transform's init. Make sure you have "
                "called init first and pass the state returned by this transform."
            )
        synced, finite = sync(updates, cfg)
        if cfg.check_finite:
            return synced, SyncState(all_finite=finite)
        return synced, state

    return init_fn, update_fn

"""Public API: ``sync_gradients``, the optax factories and ``broadcast_params``."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, NamedTuple

import numpy as np

import jax
import jax.numpy as jnp
import optax

from . import _axis_backend, _intra, _invariance, _mpi_backend, _sparse, _strategies
from ._plan import (DEFAULT_BUCKET_BYTES, DEFAULT_PACK_THRESHOLD, REDUCED_DTYPES,
                    _check_bytes, make_plan)

# flat packs every leaf: its default buckets stay below glibc's largest mmap
# threshold (32 MiB on 64-bit), so a packed temporary is never an mmap/munmap
# pair with fresh page faults on every step.
FLAT_BUCKET_BYTES = 16 * 2**20
from ._topology import default_comm

PyTree = Any
AUTO = "auto"
_REDUCES = ("mean", "sum")
_STAGINGS = ("device", "host")
_CHECKS = (False, True, "raise")


def _bad_type(fn, arg, expected, got, fix):
    return TypeError(f"{fn} got unexpected type for argument {arg!r} (expected: "
                     f"{expected}, got: {type(got).__name__} {got!r}). Fix: {fix}")


def _normalize_axes(fn: str, axis_name) -> tuple:
    if axis_name is None:
        return ()
    if isinstance(axis_name, str):
        return (axis_name,)
    if isinstance(axis_name, tuple) and all(isinstance(a, str) for a in axis_name):
        if len(set(axis_name)) != len(axis_name):
            raise ValueError(f"{fn}: axis_name {axis_name!r} repeats an axis. Fix: name "
                             f"each axis once, e.g. {tuple(dict.fromkeys(axis_name))!r}.")
        return axis_name
    if isinstance(axis_name, list):
        raise _bad_type(fn, "axis_name", "a str or a tuple of str", axis_name,
                        f"pass a tuple: axis_name={tuple(axis_name)!r}")
    raise _bad_type(fn, "axis_name", "a str, a tuple of str, or None", axis_name,
                    "pass the axis name(s) bound by shard_map/pmap/vmap, e.g. "
                    "axis_name='data'")


def _make_backend(fn: str, comm, staging: str, timeout=None):
    if isinstance(comm, str) and comm == AUTO:
        comm = default_comm()
    if comm is None:
        return _axis_backend.LocalBackend()
    if isinstance(comm, _axis_backend.AxisComm):
        return _axis_backend.AxisBackend(comm)
    _check_comm_type(fn, comm)
    if comm.Get_size() == 1:
        return _axis_backend.LocalBackend()
    return _mpi_backend.MPIBackend(comm, staging=staging,
                                   timeout=None if timeout is None else float(timeout))


def _check_comm_type(fn: str, comm) -> None:
    """TypeError unless ``comm`` is None, 'auto', an AxisComm or an Intracomm."""
    if comm is None or isinstance(comm, _axis_backend.AxisComm) or (
            isinstance(comm, str) and comm == AUTO):
        return
    # An mpi4py communicator exists only once mpi4py.MPI is imported: never import
    # it (which initialises MPI) just to reject a wrong argument.
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None and isinstance(comm, MPI.Intracomm):
        return
    raise _bad_type(fn, "comm", "an mpi4py Intracomm, jaxsync.AxisComm, None or "
                    "'auto'", comm, "pass comm=MPI.COMM_WORLD, "
                    "comm=jaxsync.AxisComm('host') or comm=None")


def _check_dtype(fn, comm_dtype):
    if comm_dtype is None:
        return None
    try:
        dt = str(jnp.dtype(comm_dtype))
    except TypeError:
        raise _bad_type(fn, "comm_dtype", f"one of {REDUCED_DTYPES} or None",
                        comm_dtype, "pass e.g. comm_dtype=jnp.bfloat16") from None
    if dt not in REDUCED_DTYPES:
        raise ValueError(f"{fn}: comm_dtype must be one of {REDUCED_DTYPES} or None, "
                         f"got {dt}. Fix: pass e.g. comm_dtype=jnp.bfloat16.")
    return dt


@dataclasses.dataclass(frozen=True)
class SyncConfig:
    """Validated static configuration of one synchronisation."""

    strategy: str
    axes: tuple
    backend: Any
    reduce: str = "mean"
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES
    pack_threshold: int | None = DEFAULT_PACK_THRESHOLD
    comm_dtype: str | None = None
    predivide: float | None = None
    check_finite: Any = False
    sparse: Any = None  # _sparse.SparseOptions: how RowSparse leaves travel
    auto: Any = None  # strategy="auto": what it decides from (_auto.AutoSpec)

    def describe(self) -> str:
        return (f"strategy {self.strategy} reduce {self.reduce} comm_dtype "
                f"{self.comm_dtype} predivide {self.predivide} check_finite "
                f"{self.check_finite!r} backend {self.backend.name} staging "
                f"{getattr(self.backend, 'staging', None)} timeout "
                f"{getattr(self.backend, 'timeout', None)}"
                + (f" auto profile {self.auto.profile.digest()}" if self.auto else ""))


def make_config(fn, strategy, axis_name, comm, *, reduce="mean",
                bucket_bytes=AUTO, pack_threshold=AUTO,
                comm_dtype=None, predivide=None, check_finite=False,
                staging="device", timeout=None, sparse=None,
                profile=None) -> SyncConfig:
    """Validate every static option; raise TypeError/ValueError naming it."""
    if isinstance(strategy, str) and strategy == AUTO:
        from . import _auto  # the strategy is chosen at trace time (_sync)
        return _auto.make_auto_config(
            fn, axis_name, comm, profile=profile, reduce=reduce, bucket_bytes=bucket_bytes,
            pack_threshold=pack_threshold, comm_dtype=comm_dtype, predivide=predivide,
            check_finite=check_finite, staging=staging, timeout=timeout, sparse=sparse)
    if profile is not None:
        raise ValueError(f"{fn}: profile is used by strategy='auto' only, got strategy="
                         f"{strategy!r}. Fix: strategy='auto', or drop profile.")
    if strategy not in _strategies.STRATEGIES:
        raise ValueError(f"{fn}: strategy must be one of {_strategies.STRATEGIES} or "
                         f"'auto', got {strategy!r}.")
    axes = _normalize_axes(fn, axis_name)
    if not isinstance(reduce, str) or reduce not in _REDUCES:
        raise ValueError(f"{fn}: reduce must be one of {_REDUCES}, got {reduce!r}. "
                         "Fix: reduce='mean' (default) or reduce='sum'.")
    if isinstance(bucket_bytes, str) and bucket_bytes == AUTO:
        bucket_bytes = FLAT_BUCKET_BYTES if strategy == "flat" else DEFAULT_BUCKET_BYTES
    _check_bytes("bucket_bytes", bucket_bytes, allow_none=True)
    if isinstance(pack_threshold, str) and pack_threshold == AUTO:
        pack_threshold = None if strategy == "flat" else DEFAULT_PACK_THRESHOLD
    _check_bytes("pack_threshold", pack_threshold, allow_none=True)
    dt = _check_dtype(fn, comm_dtype)
    if predivide is not None and (isinstance(predivide, bool)
                                  or not isinstance(predivide, (int, float))):
        raise _bad_type(fn, "predivide", "a Python float >= 1 or None", predivide,
                        "pass e.g. predivide=8.0 (a traced value cannot be static)")
    if predivide is not None and (not predivide >= 1.0 or not np.isfinite(predivide)):
        raise ValueError(f"{fn}: predivide must be a finite float >= 1, got "
                         f"{predivide}. Fix: predivide=1.0 (off) or the replica count.")
    if not (isinstance(check_finite, bool) or check_finite == "raise"):
        raise ValueError(f"{fn}: check_finite must be one of {_CHECKS}, got "
                         f"{check_finite!r}. Fix: check_finite=True (a flag in the "
                         "state) or check_finite='raise' (an error naming the leaves).")
    if staging not in _STAGINGS:
        raise ValueError(f"{fn}: staging must be one of {_STAGINGS}, got {staging!r}. "
                         "Fix: staging='device' (default) or staging='host'.")
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise _bad_type(fn, "timeout", "a number of seconds or None", timeout,
                            "pass e.g. timeout=60.0, or None to turn the watchdog off")
        if not timeout > 0:
            raise ValueError(f"{fn}: timeout must be > 0 seconds, got {timeout}. "
                             "Fix: timeout=60.0, or None (off).")
    sparse = _sparse.check_options(fn, sparse)
    if strategy == "single_node":
        # No inter-process stage: a communicator would be silently ignored.
        _check_comm_type(fn, comm)
        if not (comm is None or (isinstance(comm, str) and comm == AUTO)):
            raise ValueError(
                f"{fn}: strategy 'single_node' reduces over the local axes only and "
                f"ignores comm, got comm={comm!r}. Fix: drop comm (or pass comm=None), "
                "or use strategy='hierarchical' to reduce across processes.")
        backend = _axis_backend.LocalBackend()
    else:
        backend = _make_backend(fn, comm, staging, timeout)
    return SyncConfig(strategy, axes, backend, reduce, bucket_bytes, pack_threshold,
                      dt, None if predivide is None else float(predivide), check_finite,
                      sparse=sparse)


def _sync(tree: PyTree, cfg: SyncConfig):
    """Reduce ``tree`` per ``cfg``; returns (tree, all_finite or None)."""
    if _sparse.has_row_sparse(tree):  # RowSparse leaves are all-gathered
        return _sparse.sync_mixed(tree, cfg, _sync)
    _intra.check_axes(cfg.axes)
    if cfg.strategy == AUTO:  # chosen now, from the tree (jaxsync._auto)
        from . import _auto
        cfg = _auto.resolve(tree, cfg)
    _check_unsynced_devices(cfg)
    intra = _intra.AxisOps(cfg.axes)
    alone = intra.size == 1 and getattr(cfg.backend, "native", False)
    # One device per process and jaxsync's native allreduce: hierarchical,
    # two_dimensional and flat hand it the leaves as they are, and it sums the
    # small ones together itself (a memcpy into one MPI message): nothing is
    # packed or unpacked in XLA.
    per_leaf = cfg.strategy == "naive" or (
        alone and cfg.strategy in ("hierarchical", "two_dimensional", "flat"))
    # flat's packing is then the native target's: every leaf of one dtype into
    # messages of up to bucket_bytes, through a scratch buffer it reuses.
    group = None
    if alone and cfg.strategy == "flat":
        group = cfg.bucket_bytes if cfg.bucket_bytes is not None else 2**62
    plan = make_plan(tree, bucket_bytes=cfg.bucket_bytes,
                     pack_threshold=cfg.pack_threshold, per_leaf=per_leaf)
    agreed = (f"{plan.describe()}\n{cfg.describe()}\nreplicas per process "
              f"{intra.size}")
    n = intra.size * cfg.backend.size()
    if cfg.axes and alone:
        # One device per process: no local stage at all (no psum, no leader
        # choice, no broadcast); the MPI results are typed invariant over the
        # size-1 axes directly.
        intra = _intra.AxisOps((), unit_axes=cfg.axes)
    tree = _invariance.share_invariant(tree, cfg.axes + cfg.backend.mesh_axes)
    dtypes = [jnp.dtype(b.dtype) for b in plan.buckets]
    travel = [jnp.dtype(cfg.comm_dtype) if cfg.comm_dtype else dt for dt in dtypes]
    pres = [_predivide(cfg, dt, n) for dt in travel]

    def prepare(k, leaf):
        # Cast and scale each leaf before it is packed: fuses into its producer.
        return _scale_before(leaf.astype(travel[k]), pres[k])

    bufs = plan.pack(tree, prepare)
    # Checked by every process the first time the compiled step runs, before
    # any buffer travels (never while tracing: a process may trace alone).
    bufs = cfg.backend.agree(agreed, "gradient tree", bufs)
    bufs = _strategies.run(cfg.strategy, bufs, intra, cfg.backend, group_bytes=group)
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
    return result, finite


def _check_unsynced_devices(cfg: SyncConfig) -> None:
    """Devices of a mapped axis left out of ``axis_name`` would all talk MPI.

    Inside ``shard_map``/``pmap`` every device runs the MPI stage for the axes it
    is not synchronised over, concurrently on one communicator: the messages of
    different devices would be matched with each other (wrong sums or a hang).
    ``vmap`` axes are fine (every replica is a row of one message).
    """
    if not isinstance(cfg.backend, _mpi_backend.MPIBackend):
        return
    bad = [a for a, n in _intra.bound_axes().items() if n > 1 and a not in cfg.axes
           and not _intra._is_batched(jax.lax.axis_index(a))]
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
            "process).")


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _predivide(cfg: SyncConfig, travel_dtype, n: int) -> float:
    """The factor divided out before the sum (1.0: none)."""
    if cfg.predivide is not None:
        return cfg.predivide
    if cfg.reduce == "mean" and (_is_pow2(n) or str(travel_dtype) == "float16"):
        # A power of two is exact to divide by first (the scaled sum is the
        # scaled sum, bit for bit, away from subnormals) and fuses into the
        # pack; float16 is always divided first so the sum cannot overflow.
        return float(n)
    return 1.0


def _scale_before(b, pre: float):
    if pre == 1.0:
        return b
    if _is_pow2(int(pre)) and float(int(pre)) == pre:
        return b * jnp.asarray(1.0 / pre, b.dtype)  # exact; a multiply fuses best
    return b / jnp.asarray(pre, b.dtype)


def _reduced_leaves(plan, result):
    leaves = jax.tree_util.tree_leaves(result)
    return [(spec.path, leaves[i]) for i, spec in enumerate(plan.leaves)
            if spec.reduced and spec.size]


def _raise_if_nonfinite(named):
    if not named:
        return
    names = [n for n, _ in named]
    flags = jnp.stack([jnp.all(jnp.isfinite(x)) for _, x in named])

    def check(flags):
        bad = [n for n, ok in zip(names, np.asarray(flags)) if not ok]
        if bad:
            raise FloatingPointError(
                f"jaxsync: non-finite values after the gradient reduction in "
                f"{len(bad)} leaf/leaves: {', '.join(bad[:10])}"
                f"{' ...' if len(bad) > 10 else ''}. Every replica sees the same "
                "values. Use check_finite=True and optax.apply_if_finite to skip "
                "such steps instead of failing.")

    jax.debug.callback(check, flags)


def sync_gradients(tree: PyTree, *, axis_name, strategy: str = "hierarchical",
                   comm=AUTO, **options) -> PyTree:
    """Reduce a gradient pytree over every replica; a pure function.

    Call it inside ``shard_map``, ``pmap`` or ``vmap(axis_name=...)``. Options are
    those of the transforms (``reduce``, ``bucket_bytes``, ``pack_threshold``,
    ``comm_dtype``, ``predivide``, ``check_finite``, ``staging``, ``timeout``).
    ``strategy="auto"`` picks the strategy from the cost model (see
    :func:`jaxsync.auto_mean`; also ``profile=``).
    For use in a training loop, prefer the optax factories, which validate
    options once.

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
    cfg = make_config("sync_gradients", strategy, axis_name, comm, **options)
    out, finite = _sync(tree, cfg)
    return (out, finite) if cfg.check_finite else out


class SyncState(NamedTuple):
    """State of a jaxsync transform made with ``check_finite=True``.

    Attributes:
      all_finite: whether the last synchronised gradients were all finite; the
        same on every replica.
    """

    all_finite: jax.Array


def _transform(fn: str, strategy: str, axis_name, comm, **options):
    cfg = make_config(fn, strategy, axis_name, comm, **options)
    return optax.GradientTransformation(*transform_fns(fn, cfg))


def transform_fns(fn: str, cfg: SyncConfig):
    """``(init_fn, update_fn)`` of a transform that synchronises with ``cfg``."""
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
                "called init first and pass the state returned by this transform.")
        synced, finite = _sync(updates, cfg)
        if cfg.check_finite:
            return synced, SyncState(all_finite=finite)
        return synced, state

    return init_fn, update_fn


_OPTIONS_DOC = """
    Args:
      axis_name: the mesh axis name, or tuple of names, of the replicas inside
        this process (bound by ``shard_map``, ``pmap`` or ``vmap``); ``None``
        when each process has a single device and no mapped axis.
      comm: the inter-process stage: an mpi4py communicator, a
        :class:`jaxsync.AxisComm` (a mesh axis), ``None`` (one process) or
        ``"auto"`` (``MPI.COMM_WORLD`` when launched by MPI with several
        processes, else ``None``).
      reduce: ``"mean"`` (divide by devices x processes) or ``"sum"``.
      bucket_bytes: cap on one packed buffer (``None``: no cap). Default: 16 MiB
        for ``flat_mean`` (below glibc's 32 MiB mmap threshold, so a packed
        temporary is reused from the heap, not mapped afresh each step), 64 MiB
        otherwise.
      pack_threshold: leaves of at least this many bytes travel in their own
        buffer without a copy (``None``: pack everything). Default: ``None``
        for ``flat_mean``, 256 KiB otherwise.
      comm_dtype: dtype on the wire (``None``: each buffer's own dtype). 16-bit
        data is always summed in float32.
      predivide: divide by this before the sum and by ``n / predivide`` after
        (Horovod's ``gradient_predivide_factor``). Default ``None``: with
        ``reduce="mean"``, the replica count ``n`` when it is a power of two
        (exact, and it fuses into packing: no pass after the sum) or the data is
        float16 (so the sum cannot overflow), else 1 (the division by ``n``
        fuses into unpacking).
      check_finite: ``True`` keeps ``all_finite`` in the state; ``"raise"`` also
        raises ``FloatingPointError`` naming the non-finite leaves.
      staging: ``"device"`` or ``"host"`` (MPI through host memory).
      timeout: seconds (MPI only; default ``None``, off): when this process has
        waited longer than this in one inter-process stage, a watchdog prints
        which ranks have not arrived. The synchronisation keeps waiting.
      sparse: a :class:`jaxsync.SparseOptions` (default ``None``: automatic):
        how :class:`jaxsync.RowSparse` leaves are synchronised (all-gathered
        indices and values, or scattered and reduced dense).
"""


def _factory(strategy: str, fn: str, doc: str, *, has_comm=True):
    if has_comm:
        def factory(axis_name, comm=AUTO, **options) -> optax.GradientTransformation:
            return _transform(fn, strategy, axis_name, comm, **options)
    else:
        def factory(axis_name, **options) -> optax.GradientTransformation:
            if "comm" in options:
                raise TypeError(f"{fn} got an unexpected argument 'comm': it reduces over "
                                "the local axes only. Fix: drop comm, or use "
                                "hierarchical_mean(axis_name, comm=...) across processes.")
            return _transform(fn, strategy, axis_name, None, **options)
    factory.__name__ = factory.__qualname__ = fn
    factory.__doc__ = doc + _OPTIONS_DOC
    return factory


naive_mean = _factory("naive", "naive_mean", """Average gradients leaf by leaf.

    One reduction per leaf over the local axes, then one inter-process allreduce
    per leaf (ChainerMN ``naive``). Simple and the slowest with many small leaves.

    Example:
      >>> import jax, jax.numpy as jnp, jaxsync
      >>> tx = jaxsync.naive_mean(axis_name="i", comm=None)
      >>> f = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(f, axis_name="i")({"w": jnp.arange(4.0)})["w"]
      Array([1.5, 1.5, 1.5, 1.5], dtype=float32)
""")

flat_mean = _factory("flat", "flat_mean", """Average gradients packed into a few buffers.

    Every leaf is packed into one buffer per dtype (split into buckets of at
    most ``bucket_bytes``); one reduction over the local axes, one inter-process
    allreduce per buffer by local device 0, broadcast over the local axes
    (ChainerMN ``flat``).

    Example:
      >>> import jax, jax.numpy as jnp, jaxsync
      >>> tx = jaxsync.flat_mean(axis_name="i", comm=None)
      >>> f = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(f, axis_name="i")({"w": jnp.arange(4.0)})["w"]
      Array([1.5, 1.5, 1.5, 1.5], dtype=float32)
""")

hierarchical_mean = _factory("hierarchical", "hierarchical_mean", """Average gradients hierarchically.

    Sum over the local axes, one inter-process allreduce per process (by local
    device 0), broadcast back over the local axes (ChainerMN ``hierarchical``,
    Caffe2 ``_AllReduceBlobsDistributed``). The inter-process traffic is one
    buffer per process: the right default with several devices per process.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxsync
      >>> tx = optax.chain(jaxsync.hierarchical_mean(axis_name="i", comm=None),
      ...                  optax.sgd(1.0))
      >>> f = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(f, axis_name="i")({"w": jnp.arange(4.0)})["w"]
      Array([-1.5, -1.5, -1.5, -1.5], dtype=float32)
""")

two_dimensional_mean = _factory("two_dimensional", "two_dimensional_mean", """Average gradients two-dimensionally.

    Reduce-scatter over the local axes, every local device allreduces its slice
    across processes on its own communicator (the world split by local device
    index), all-gather over the local axes (ChainerMN ``two_dimensional``,
    Horovod hierarchical allreduce). Spreads inter-process traffic over all
    local devices.

    Example:
      >>> import jax, jax.numpy as jnp, jaxsync
      >>> tx = jaxsync.two_dimensional_mean(axis_name="i", comm=None)
      >>> f = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(f, axis_name="i")({"w": jnp.arange(4.0)})["w"]
      Array([1.5, 1.5, 1.5, 1.5], dtype=float32)
""")

single_node_mean = _factory("single_node", "single_node_mean", """Average gradients over the local axes only.

    One packed reduction over the devices of this process, no inter-process stage
    (ChainerMN ``single_node``, Caffe2 ``_AllReduceBlobsSingleHost``).

    Example:
      >>> import jax, jax.numpy as jnp, jaxsync
      >>> tx = jaxsync.single_node_mean(axis_name="i")
      >>> f = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(f, axis_name="i")({"w": jnp.arange(4.0)})["w"]
      Array([1.5, 1.5, 1.5, 1.5], dtype=float32)
""", has_comm=False)

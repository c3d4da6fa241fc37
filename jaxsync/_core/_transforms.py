"""The public optax factories: one per strategy, each a thin typed front of
``_config.make_config`` (validation when the factory is called) and
``_sync.transform_fns`` (the init/update pair).

Imports: ``_config``, ``_sync`` and ``_join`` (weights=) only (``_sparse`` for a type).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import optax

from . import _join
from ._config import AUTO, make_config
from ._overlap_doc import document_overlap
from ._sync import transform_fns

if TYPE_CHECKING:  # annotations only: the core does not import jaxsync.sparse
    from jaxsync.sparse._rows import SparseOptions

    from ._config import AxisName, Bytes, CheckFinite, Comm, DTypeLike, OnTimeout, Reduce, Staging


def _transform(
    fn: str,
    strategy: str,
    axis_name,
    comm=None,
    weights=False,
    early_termination="join",
    **options,
) -> optax.GradientTransformation:
    # ``**locals()``: the factory's own (typed, documented) parameters, all validated.
    cfg = make_config(fn, strategy, axis_name, comm, **options)
    _join.check_early_termination(fn, early_termination, weights)
    if weights is not False:  # per-replica weights and the join (_join)
        fns = lambda c: transform_fns(fn, c)
        return _join.transform(fn, cfg, weights, fns, early_termination=early_termination)
    return optax.GradientTransformation(*transform_fns(fn, cfg))


@document_overlap
def naive_mean(
    axis_name: AxisName,
    comm: Comm = AUTO,
    *,
    reduce: Reduce = "mean",
    bucket_bytes: Bytes = AUTO,
    pack_threshold: Bytes = AUTO,
    comm_dtype: DTypeLike | None = None,
    predivide: float | None = None,
    check_finite: CheckFinite = False,
    staging: Staging = "device",
    timeout: float | None = None,
    on_timeout: OnTimeout = "report",
    sparse: SparseOptions | None = None,
    overlap: bool | Literal["auto"] = AUTO,
    overlap_bucket_bytes: int | Literal["auto"] = AUTO,
    double_buffering: bool = False,
    weights: _join.Weights = False,
    early_termination: _join.EarlyTermination = "join",
) -> optax.GradientTransformation:
    """Average gradients leaf by leaf.

    One reduction per leaf over the local axes, then one inter-process allreduce
    per leaf (ChainerMN ``naive``). Simple and the slowest with many small leaves.

    Args:
      axis_name: the mesh axis name, or tuple of names, of the replicas inside
        this process (bound by ``shard_map``, ``pmap`` or ``vmap``); ``None``
        when each process has a single device and no mapped axis.
      comm: the inter-process stage: an mpi4py communicator, a
        :class:`jaxsync.AxisComm` (a mesh axis), ``None`` (one process) or
        ``"auto"`` (``MPI.COMM_WORLD`` when launched by MPI with several
        processes, else ``None``).
      reduce: ``"mean"`` (divide by devices x processes) or ``"sum"``.
      bucket_bytes: cap on one packed buffer (``None``: no cap; ``"auto"``:
        64 MiB).
      pack_threshold: leaves of at least this many bytes travel in their own
        buffer without a copy (``None``: pack everything; ``"auto"``:
        256 KiB).
      comm_dtype: dtype on the wire (``None``: each buffer's own dtype; or
        ``jnp.bfloat16``/``jnp.float16``, lossy, or a :class:`jaxsync.Quantized`:
        8/4 bits). Always summed in float32 (16-bit: rounded once).
      predivide: divide by this before the sum and by ``n / predivide`` after
        (Horovod's ``gradient_predivide_factor``). ``None``: with
        ``reduce="mean"``, the replica count ``n`` if a power of two (exact,
        fused into packing); float16: the largest power of two <= ``n`` (exact;
        overflows only near float16's limit); else 1 (divided at unpacking).
      check_finite: ``True`` keeps ``all_finite`` in the state
        (:class:`jaxsync.SyncState`); ``"raise"`` also raises
        ``FloatingPointError`` naming the non-finite leaves.
      staging: ``"device"``, or ``"host"`` (MPI through host memory, for an MPI
        without GPU support).
      timeout: seconds (MPI only; ``None``: off): when this process has waited
        longer than this in one inter-process stage (the first execution's
        agreement included), a watchdog thread prints which ranks have not
        arrived, which synchronisation and which step.
      on_timeout: what the watchdog does then: ``"report"`` (default) keeps
        waiting (the result is unchanged when the straggler arrives);
        ``"abort"`` makes every process that can still answer print the same
        diagnosis once and ends the job with ``MPI_Abort`` (a non-zero exit),
        also when a peer is dead or unreachable. Needs ``timeout``.
      sparse: how :class:`jaxsync.RowSparse` leaves are synchronised (a
        :class:`jaxsync.SparseOptions`; ``None``: automatic).
    Returns:
      an ``optax.GradientTransformation`` whose ``update`` returns the reduced
      gradients, the same on every replica. Its state is
      ``optax.EmptyState()``, or :class:`jaxsync.SyncState` with
      ``check_finite``.

    Example:
      >>> import jax, jax.numpy as jnp, jaxsync
      >>> tx = jaxsync.naive_mean(axis_name="i", comm=None)
      >>> f = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(f, axis_name="i")({"w": jnp.arange(4.0)})["w"]
      Array([1.5, 1.5, 1.5, 1.5], dtype=float32)
    """
    return _transform("naive_mean", "naive", **locals())


@document_overlap
def flat_mean(
    axis_name: AxisName,
    comm: Comm = AUTO,
    *,
    reduce: Reduce = "mean",
    bucket_bytes: Bytes = AUTO,
    pack_threshold: Bytes = AUTO,
    comm_dtype: DTypeLike | None = None,
    predivide: float | None = None,
    check_finite: CheckFinite = False,
    staging: Staging = "device",
    timeout: float | None = None,
    on_timeout: OnTimeout = "report",
    sparse: SparseOptions | None = None,
    overlap: bool | Literal["auto"] = AUTO,
    overlap_bucket_bytes: int | Literal["auto"] = AUTO,
    double_buffering: bool = False,
    weights: _join.Weights = False,
    early_termination: _join.EarlyTermination = "join",
    host_tier: bool | Literal["auto"] = AUTO,
) -> optax.GradientTransformation:
    """Average gradients packed into a few buffers.

    Every leaf is packed into one buffer per dtype (split into buckets of at
    most ``bucket_bytes``); one reduction over the local axes, one inter-process
    allreduce per buffer by local device 0, broadcast over the local axes
    (ChainerMN ``flat``).

    Args:
      axis_name: the mesh axis name, or tuple of names, of the replicas inside
        this process (bound by ``shard_map``, ``pmap`` or ``vmap``); ``None``
        when each process has a single device and no mapped axis.
      comm: the inter-process stage: an mpi4py communicator, a
        :class:`jaxsync.AxisComm` (a mesh axis), ``None`` (one process) or
        ``"auto"`` (``MPI.COMM_WORLD`` when launched by MPI with several
        processes, else ``None``).
      reduce: ``"mean"`` (divide by devices x processes) or ``"sum"``.
      bucket_bytes: cap on one packed buffer (``None``: no cap; ``"auto"``:
        4 MiB: on CPU larger packed buffers cost more in copies and fresh
        pages than they save in messages - with 8 devices of one process 16 MiB
        buckets took 4x longer on a ResNet-18-sized tree; a leaf larger than
        the cap travels alone, without a copy).
      pack_threshold: leaves of at least this many bytes travel in their own
        buffer without a copy (``None``: pack everything; ``"auto"``:
        ``None``).
      comm_dtype: dtype on the wire (``None``: each buffer's own dtype; or
        ``jnp.bfloat16``/``jnp.float16``, lossy, or a :class:`jaxsync.Quantized`:
        8/4 bits). Always summed in float32 (16-bit: rounded once).
      predivide: divide by this before the sum and by ``n / predivide`` after
        (Horovod's ``gradient_predivide_factor``). ``None``: with
        ``reduce="mean"``, the replica count ``n`` if a power of two (exact,
        fused into packing); float16: the largest power of two <= ``n`` (exact;
        overflows only near float16's limit); else 1 (divided at unpacking).
      check_finite: ``True`` keeps ``all_finite`` in the state
        (:class:`jaxsync.SyncState`); ``"raise"`` also raises
        ``FloatingPointError`` naming the non-finite leaves.
      staging: ``"device"``, or ``"host"`` (MPI through host memory, for an MPI
        without GPU support).
      timeout: seconds (MPI only; ``None``: off): when this process has waited
        longer than this in one inter-process stage (the first execution's
        agreement included), a watchdog thread prints which ranks have not
        arrived, which synchronisation and which step.
      on_timeout: what the watchdog does then: ``"report"`` (default) keeps
        waiting (the result is unchanged when the straggler arrives);
        ``"abort"`` makes every process that can still answer print the same
        diagnosis once and ends the job with ``MPI_Abort`` (a non-zero exit),
        also when a peer is dead or unreachable. Needs ``timeout``.
      sparse: how :class:`jaxsync.RowSparse` leaves are synchronised (a
        :class:`jaxsync.SparseOptions`; ``None``: automatic).
    Returns:
      an ``optax.GradientTransformation`` whose ``update`` returns the reduced
      gradients, the same on every replica. Its state is
      ``optax.EmptyState()``, or :class:`jaxsync.SyncState` with
      ``check_finite``.

    Example:
      >>> import jax, jax.numpy as jnp, jaxsync
      >>> tx = jaxsync.flat_mean(axis_name="i", comm=None)
      >>> f = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(f, axis_name="i")({"w": jnp.arange(4.0)})["w"]
      Array([1.5, 1.5, 1.5, 1.5], dtype=float32)
    """
    return _transform("flat_mean", "flat", **locals())


@document_overlap
def hierarchical_mean(
    axis_name: AxisName,
    comm: Comm = AUTO,
    *,
    reduce: Reduce = "mean",
    bucket_bytes: Bytes = AUTO,
    pack_threshold: Bytes = AUTO,
    comm_dtype: DTypeLike | None = None,
    predivide: float | None = None,
    check_finite: CheckFinite = False,
    staging: Staging = "device",
    timeout: float | None = None,
    on_timeout: OnTimeout = "report",
    sparse: SparseOptions | None = None,
    overlap: bool | Literal["auto"] = AUTO,
    overlap_bucket_bytes: int | Literal["auto"] = AUTO,
    double_buffering: bool = False,
    weights: _join.Weights = False,
    early_termination: _join.EarlyTermination = "join",
    host_tier: bool | Literal["auto"] = AUTO,
) -> optax.GradientTransformation:
    """Average gradients hierarchically.

    Sum over the local axes, one inter-process allreduce per process (by local
    device 0), broadcast back over the local axes (ChainerMN ``hierarchical``,
    Caffe2 ``_AllReduceBlobsDistributed``). The inter-process traffic is one
    buffer per process: the right default with several devices per process.

    Args:
      axis_name: the mesh axis name, or tuple of names, of the replicas inside
        this process (bound by ``shard_map``, ``pmap`` or ``vmap``); ``None``
        when each process has a single device and no mapped axis.
      comm: the inter-process stage: an mpi4py communicator, a
        :class:`jaxsync.AxisComm` (a mesh axis), ``None`` (one process) or
        ``"auto"`` (``MPI.COMM_WORLD`` when launched by MPI with several
        processes, else ``None``).
      reduce: ``"mean"`` (divide by devices x processes) or ``"sum"``.
      bucket_bytes: cap on one packed buffer (``None``: no cap; ``"auto"``:
        64 MiB).
      pack_threshold: leaves of at least this many bytes travel in their own
        buffer without a copy (``None``: pack everything; ``"auto"``:
        256 KiB).
      comm_dtype: dtype on the wire (``None``: each buffer's own dtype; or
        ``jnp.bfloat16``/``jnp.float16``, lossy, or a :class:`jaxsync.Quantized`:
        8/4 bits). Always summed in float32 (16-bit: rounded once).
      predivide: divide by this before the sum and by ``n / predivide`` after
        (Horovod's ``gradient_predivide_factor``). ``None``: with
        ``reduce="mean"``, the replica count ``n`` if a power of two (exact,
        fused into packing); float16: the largest power of two <= ``n`` (exact;
        overflows only near float16's limit); else 1 (divided at unpacking).
      check_finite: ``True`` keeps ``all_finite`` in the state
        (:class:`jaxsync.SyncState`); ``"raise"`` also raises
        ``FloatingPointError`` naming the non-finite leaves.
      staging: ``"device"``, or ``"host"`` (MPI through host memory, for an MPI
        without GPU support).
      timeout: seconds (MPI only; ``None``: off): when this process has waited
        longer than this in one inter-process stage (the first execution's
        agreement included), a watchdog thread prints which ranks have not
        arrived, which synchronisation and which step.
      on_timeout: what the watchdog does then: ``"report"`` (default) keeps
        waiting (the result is unchanged when the straggler arrives);
        ``"abort"`` makes every process that can still answer print the same
        diagnosis once and ends the job with ``MPI_Abort`` (a non-zero exit),
        also when a peer is dead or unreachable. Needs ``timeout``.
      sparse: how :class:`jaxsync.RowSparse` leaves are synchronised (a
        :class:`jaxsync.SparseOptions`; ``None``: automatic).
    Returns:
      an ``optax.GradientTransformation`` whose ``update`` returns the reduced
      gradients, the same on every replica. Its state is
      ``optax.EmptyState()``, or :class:`jaxsync.SyncState` with
      ``check_finite``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxsync
      >>> tx = optax.chain(jaxsync.hierarchical_mean(axis_name="i", comm=None),
      ...                  optax.sgd(1.0))
      >>> f = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(f, axis_name="i")({"w": jnp.arange(4.0)})["w"]
      Array([-1.5, -1.5, -1.5, -1.5], dtype=float32)
    """
    return _transform("hierarchical_mean", "hierarchical", **locals())


@document_overlap
def two_dimensional_mean(
    axis_name: AxisName,
    comm: Comm = AUTO,
    *,
    reduce: Reduce = "mean",
    bucket_bytes: Bytes = AUTO,
    pack_threshold: Bytes = AUTO,
    comm_dtype: DTypeLike | None = None,
    predivide: float | None = None,
    check_finite: CheckFinite = False,
    staging: Staging = "device",
    timeout: float | None = None,
    on_timeout: OnTimeout = "report",
    sparse: SparseOptions | None = None,
    overlap: bool | Literal["auto"] = AUTO,
    overlap_bucket_bytes: int | Literal["auto"] = AUTO,
    double_buffering: bool = False,
    weights: _join.Weights = False,
    early_termination: _join.EarlyTermination = "join",
    host_tier: bool | Literal["auto"] = AUTO,
) -> optax.GradientTransformation:
    """Average gradients two-dimensionally.

    Reduce-scatter over the local axes, every local device allreduces its slice
    across processes on its own communicator (the world split by local device
    index), all-gather over the local axes (ChainerMN ``two_dimensional``,
    Horovod hierarchical allreduce). Spreads inter-process traffic over all
    local devices.

    Args:
      axis_name: the mesh axis name, or tuple of names, of the replicas inside
        this process (bound by ``shard_map``, ``pmap`` or ``vmap``); ``None``
        when each process has a single device and no mapped axis.
      comm: the inter-process stage: an mpi4py communicator, a
        :class:`jaxsync.AxisComm` (a mesh axis), ``None`` (one process) or
        ``"auto"`` (``MPI.COMM_WORLD`` when launched by MPI with several
        processes, else ``None``).
      reduce: ``"mean"`` (divide by devices x processes) or ``"sum"``.
      bucket_bytes: cap on one packed buffer (``None``: no cap; ``"auto"``:
        64 MiB).
      pack_threshold: leaves of at least this many bytes travel in their own
        buffer without a copy (``None``: pack everything; ``"auto"``:
        256 KiB).
      comm_dtype: dtype on the wire (``None``: each buffer's own dtype; or
        ``jnp.bfloat16``/``jnp.float16``, lossy, or a :class:`jaxsync.Quantized`:
        8/4 bits). Always summed in float32 (16-bit: rounded once).
      predivide: divide by this before the sum and by ``n / predivide`` after
        (Horovod's ``gradient_predivide_factor``). ``None``: with
        ``reduce="mean"``, the replica count ``n`` if a power of two (exact,
        fused into packing); float16: the largest power of two <= ``n`` (exact;
        overflows only near float16's limit); else 1 (divided at unpacking).
      check_finite: ``True`` keeps ``all_finite`` in the state
        (:class:`jaxsync.SyncState`); ``"raise"`` also raises
        ``FloatingPointError`` naming the non-finite leaves.
      staging: ``"device"``, or ``"host"`` (MPI through host memory, for an MPI
        without GPU support).
      timeout: seconds (MPI only; ``None``: off): when this process has waited
        longer than this in one inter-process stage (the first execution's
        agreement included), a watchdog thread prints which ranks have not
        arrived, which synchronisation and which step.
      on_timeout: what the watchdog does then: ``"report"`` (default) keeps
        waiting (the result is unchanged when the straggler arrives);
        ``"abort"`` makes every process that can still answer print the same
        diagnosis once and ends the job with ``MPI_Abort`` (a non-zero exit),
        also when a peer is dead or unreachable. Needs ``timeout``.
      sparse: how :class:`jaxsync.RowSparse` leaves are synchronised (a
        :class:`jaxsync.SparseOptions`; ``None``: automatic).
    Returns:
      an ``optax.GradientTransformation`` whose ``update`` returns the reduced
      gradients, the same on every replica. Its state is
      ``optax.EmptyState()``, or :class:`jaxsync.SyncState` with
      ``check_finite``.

    Example:
      >>> import jax, jax.numpy as jnp, jaxsync
      >>> tx = jaxsync.two_dimensional_mean(axis_name="i", comm=None)
      >>> f = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(f, axis_name="i")({"w": jnp.arange(4.0)})["w"]
      Array([1.5, 1.5, 1.5, 1.5], dtype=float32)
    """
    return _transform("two_dimensional_mean", "two_dimensional", **locals())


def single_node_mean(
    axis_name: AxisName,
    *,
    reduce: Reduce = "mean",
    bucket_bytes: Bytes = AUTO,
    pack_threshold: Bytes = AUTO,
    comm_dtype: DTypeLike | None = None,
    predivide: float | None = None,
    check_finite: CheckFinite = False,
    sparse: SparseOptions | None = None,
    weights: _join.Weights = False,
    early_termination: _join.EarlyTermination = "join",
) -> optax.GradientTransformation:
    """Average gradients over the local axes only.

    One packed reduction over the devices of this process, no inter-process stage
    (ChainerMN ``single_node``, Caffe2 ``_AllReduceBlobsSingleHost``): it takes
    no ``comm``; use :func:`jaxsync.hierarchical_mean` across processes.

    Args:
      axis_name: the mesh axis name, or tuple of names, of the replicas inside
        this process (bound by ``shard_map``, ``pmap`` or ``vmap``); ``None``
        when each process has a single device and no mapped axis.
      reduce, bucket_bytes, pack_threshold, comm_dtype, predivide, check_finite,
        sparse, weights, early_termination: as for :func:`jaxsync.hierarchical_mean`.
    Returns:
      an ``optax.GradientTransformation`` whose ``update`` returns the reduced
      gradients, the same on every replica. Its state is
      ``optax.EmptyState()``, or :class:`jaxsync.SyncState` with
      ``check_finite``.

    Example:
      >>> import jax, jax.numpy as jnp, jaxsync
      >>> tx = jaxsync.single_node_mean(axis_name="i")
      >>> f = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(f, axis_name="i")({"w": jnp.arange(4.0)})["w"]
      Array([1.5, 1.5, 1.5, 1.5], dtype=float32)
    """
    return _transform("single_node_mean", "single_node", **locals())

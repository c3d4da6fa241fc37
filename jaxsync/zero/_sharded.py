"""The parts of ``jaxsync.sharded``: its state, where a step runs, its collectives.

One step: the gradients are reduce-scattered (over the devices of a process,
then across processes) so that each replica holds the mean of its slice of
every leaf (``_layout``); the inner optimizer updates that slice, with the
matching slice of the parameters and its own slice of the state; the updates
are all-gathered back, over the processes and then the devices. The bytes on
the wire are those of one allreduce, and the optimizer's state and compute per
replica are ``1/N`` of the whole (plus padding).

Imports: the core's config, strategies (the 16-bit scatter), sync (the mean's
factors; the scalar sums of the norm and the finite check), ``_quantsum`` (the
quantized reduce-scatter), the stage's backends; ``_layout``, ``_elementwise``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxsync._comm import _axis_backend, _intra, _invariance, _mpi_backend
from jaxsync._core import _quantsum, _strategies, _sync
from jaxsync._core._reduce16 import rows_sum_f32

from ._layout import Layout

_LOW = ("float16", "bfloat16")


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["inner", "all_finite", "residual", "step"],
    meta_fields=["per_replica"],
)
@dataclasses.dataclass(frozen=True)
class ShardedState:
    """State of :func:`jaxsync.sharded`.

    Attributes:
      inner: the inner optimizer's state for this replica's slices. A leaf
        that follows the parameters (Adam's moments) holds this replica's
        slice (its leaf's rank: ``(1, ..., 1, k)``, ``(k,)`` for a vector);
        under ``shard_map`` the devices' slices stack along its first axis
        (:func:`jaxsync.state_specs`), and the processes' saved states
        concatenate along it in slice order. The other leaves (the step count)
        are the same on every replica.
      all_finite: with ``check_finite``, whether the last reduced gradients
        were all finite (the same on every replica); else None.
      per_replica: per leaf of ``inner`` (flattened), whether it is a slice
        (static).
      residual: with ``comm_dtype=jaxsync.Quantized(..., error_feedback=True)``,
        per quantized buffer (float32, ``processes x K``: the rows this replica
        quantizes) the last step's quantization error, added to the next
        step's buffer; this replica's own (under ``shard_map`` stacked along
        the first axis, as the slices). Else None.
      step: with a quantized wire, the steps taken (the stochastic rounding's
        keys fold it in); else None.
    """

    inner: Any
    all_finite: Any
    per_replica: tuple
    residual: Any = None
    step: Any = None

    def jaxsync_state_specs(self, per_replica, replicated):
        """The ``PartitionSpec``s of this state (for :func:`jaxsync.state_specs`)."""
        leaves, treedef = jax.tree.flatten(self.inner)
        specs = [per_replica if f else replicated for f in self.per_replica[: len(leaves)]]
        return ShardedState(
            jax.tree_util.tree_unflatten(treedef, specs),
            None if self.all_finite is None else replicated,
            self.per_replica,
            None if self.residual is None else tuple(per_replica for _ in self.residual),
            None if self.step is None else replicated,
        )


def per_replica_flags(inner, layout: Layout) -> tuple:
    """Which leaves of ``inner``'s state follow the slices (their shapes do)."""
    a = jax.eval_shape(inner.init, layout.tree(layout.slice_structs(0)))
    b = jax.eval_shape(inner.init, layout.tree(layout.slice_structs(1)))
    return tuple(x.shape != y.shape for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


class Place:
    """Where a traced step runs: devices per process, processes, this slice.

    ``init`` outside the map (its axes not bound: ``jax.eval_shape(tx.init,
    params)`` for :func:`jaxsync.state_specs`) is placed as one device per
    process and, for an unbound :class:`jaxsync.AxisComm`, one process: the
    state's structure is the same for any count, its shapes are not (an
    update refuses such a state with the counts).
    """

    def __init__(self, cfg, strict: bool = True):
        bound = _intra.bound_axes()
        loose = not strict and not all(a in bound for a in cfg.axes)
        axes = () if loose else cfg.axes
        _intra.check_axes(axes)
        self.intra = _intra.AxisOps(axes)
        self.devices = self.intra.size
        backend = cfg.backend
        # One device per process and jaxsync's native target: no in-process
        # stage at all (XLA keeps a reduce-scatter and an all-gather over a
        # size-1 axis, each a copy), and each leaf goes to the native
        # reduce-scatter as it is (no packing): its results are typed
        # invariant over the size-1 axes, as sync's are.
        # (a quantized wire packs: a leaf per buffer would pay a partial block each)
        self.alone = self.devices == 1 and getattr(backend, "native", False) and cfg.quant is None
        if self.alone and axes:
            self.intra = _intra.AxisOps((), unit_axes=axes)
        d = lax.axis_index(axes) if axes else 0
        if isinstance(backend, _mpi_backend.MPIBackend):
            self.processes = backend.size()
            if axes and _intra._is_batched(d) and self.processes > 1:
                raise ValueError(
                    "sharded: under vmap(axis_name=...) with MPI across processes the "
                    "replicas of a process are rows of one program, which cannot each "
                    "take their own slice across processes. Fix: run the step under "
                    "jax.shard_map or pmap over the local devices, or with comm=None "
                    "in one process."
                )
            p: Any = backend.comms.rank
        elif isinstance(backend, _axis_backend.AxisBackend) and not (
            loose and backend.axis not in bound
        ):
            self.processes = backend.size()
            p = lax.axis_index(backend.axis)
        else:
            self.processes, p = 1, 0
        self.index = p * self.devices + d


def allsum(sums_cfg, x):
    """``x`` (a small varying array) summed over every replica."""
    out, _ = _sync.sync({"x": x}, sums_cfg)
    return out["x"]


def scatter(intra, backend, bufs: list) -> list:
    """``(N * K,)`` buffers -> this replica's ``(K,)``: devices, then processes."""
    live = [i for i, b in enumerate(bufs) if b.shape[0]]
    out = list(bufs)
    got = [_strategies._scatter_sum(intra, bufs[i]) for i in live]
    got = backend.run(_inter_scatter, got, intra, leader_only=False) if got else []
    for i, y in zip(live, got):
        out[i] = y
    return out


def scatter_quant(intra, backend, bufs: list, spec, residual, step, rank):
    """:func:`scatter` with the processes' stage quantized (``spec``, the first
    half of ``_quantsum``'s schedule): the float32 buffers' rows are quantized
    (``residual``: theirs, or None), all-to-all'd and summed in float32 by
    their owner. Returns the ``(K,)`` buffers and the new residuals (as given
    where nothing crossed)."""
    live = [i for i, b in enumerate(bufs) if b.shape[0] and str(b.dtype) == "float32"]
    rest = [i for i, b in enumerate(bufs) if b.shape[0] and i not in live]
    out = list(bufs)
    for i, y in zip(rest, scatter(intra, backend, [bufs[i] for i in rest])):
        out[i] = y
    res = list(residual) if residual is not None else []
    if not live:
        return out, residual
    got = [_strategies._scatter_sum(intra, bufs[i]) for i in live]
    prog = _quantsum.scatter_program(spec, len(got), step, rank)
    got = backend.run(prog, got + res, intra, leader_only=False)
    for i, y in zip(live, got):
        out[i] = y
    return out, (tuple(got[len(live) :]) if residual is not None else None)


def scatter_leaves(intra, backend, bufs: list) -> list:
    """One device per process: each leaf's ``(P * k,)`` rows -> its ``(k,)``,
    reduce-scattered in place (the slice is the buffer's first ``k``)."""
    live = [i for i, b in enumerate(bufs) if b.shape[0]]
    out = list(bufs)
    got = backend.run(_scatter_in_place, [bufs[i] for i in live], intra, leader_only=False)
    for i, y in zip(live, got if live else []):
        out[i] = y
    return out


def gather(intra, backend, bufs: list) -> list:
    """``(K,)`` buffers -> ``(N * K,)``: processes, then devices."""
    live = [i for i, b in enumerate(bufs) if b.shape[0]]
    out = list(bufs)
    got = [bufs[i] for i in live]
    got = backend.run(_inter_gather, got, intra, leader_only=False) if got else []
    for i, y in zip(live, got):
        out[i] = intra.allgather_tiled(y)
    return out


def gather_leaves(intra, backend, bufs: list, bucket_bytes) -> list:
    """One device per process: each leaf's ``(k,)`` slice -> its ``(P * k,)``
    rows, as it is (no concatenate), the leaves in one native call per bucket
    of at most ``bucket_bytes`` gathered (the chain's buckets; None: one call).
    One call a leaf was one MPI call a leaf in the step (a transformer's 29
    against the chain's 4); one call for every leaf makes all gathered leaves
    live at once, so a bucket bounds the step's extra temporaries."""
    live = [i for i, b in enumerate(bufs) if b.shape[0]]
    out = list(bufs)
    if not live:
        return out
    groups: list[list[int]] = [[]]
    size = 0
    for i in live:
        nbytes = bufs[i].shape[0] * bufs[i].dtype.itemsize * backend.size()
        if groups[-1] and bucket_bytes is not None and size + nbytes > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes
    for group in groups:
        got = backend.run(_gather_all, [bufs[i] for i in group], intra, leader_only=False)
        for i, y in zip(group, got):
            out[i] = y
    return out


def _gather_all(ops, bufs):
    if getattr(ops, "sum16", False):  # jaxsync's native target: any number, one call
        return [y.reshape(-1) for y in ops.allgather_many(bufs)]
    return _inter_gather(ops, bufs)


def _u16(x):
    return lax.bitcast_convert_type(x, jnp.uint16)


def _inter_scatter(ops, bufs):
    if isinstance(ops, _intra.AxisOps):  # a mesh axis (AxisComm), or no processes
        return [_strategies._scatter_sum(ops, b) for b in bufs]
    if getattr(ops, "sum16", False):  # jaxsync's native target: one call, in place
        return ops.reduce_scatter(bufs)
    out = []  # mpi4jax, host staging: an all-to-all, summed here in rank order
    for b in bufs:
        rows = b.reshape(ops.size, -1)
        if str(b.dtype) in _LOW:
            got = lax.bitcast_convert_type(ops.alltoall(_u16(rows)), b.dtype)
            out.append(rows_sum_f32(got).astype(b.dtype))
        else:
            got = ops.alltoall(rows)
            total = got[0]
            for j in range(1, ops.size):
                total = total + got[j]
            out.append(total)
    return out


def _scatter_in_place(ops, bufs):
    got = ops.reduce_scatter(bufs, inplace=True)
    return [y[: -(-b.shape[0] // ops.size)] for b, y in zip(bufs, got)]


def _inter_gather(ops, bufs):
    out = []
    for b in bufs:
        if str(b.dtype) in _LOW and not isinstance(ops, _intra.AxisOps):
            got = lax.bitcast_convert_type(ops.allgather(_u16(b)), b.dtype)
        else:
            got = ops.allgather(b)
        out.append(got.reshape(-1))
    return out


def share(tree, cfg):
    return _invariance.share_invariant(tree, cfg.axes + cfg.backend.mesh_axes)

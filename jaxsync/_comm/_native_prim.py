"""The native primitive: ordered MPI collectives inside multi-device computations.

``native_p`` binds jaxsync's own XLA FFI targets (loaded by ``_mpi_load``), on CPU:

* ``jaxsync_allreduce`` sums any number of buffers in one call, in place
  (results aliased to inputs, ``MPI_IN_PLACE``);
* ``jaxsync_allreduce_async`` is the same sum on the communicator's own thread:
  it returns a future at once and XLA runs the rest of the step meanwhile
  (overlap);
* ``jaxsync_allgather`` and ``jaxsync_alltoall`` move any number of buffers,
  one after another; their ``_async`` forms do it on the communicator's thread
  (overlap with a quantized wire);
* ``jaxsync_reduce``, ``jaxsync_bcast`` (in place, any number of buffers) and
  ``jaxsync_reduce_scatter`` (buffer -> this rank's slice): the host tier's
  steps among the processes of one host (rank 0 of the communicator is the root);
* ``jaxsync_tier``: the host tier's three steps in one call (in place), pipelined
  over chunks (its ``comm`` and ``active`` are int32[2]: host, cross);
* ``jaxsync_agree`` checks every synchronisation's header (plan digest, step)
  on every run, ``jaxsync_step`` counts the steps that reach a synchronisation
  inside control flow (see ``agree.cc`` and ``_mpi_backend.MPIBackend.agree``).

Every call takes and returns an XLA token as a regular operand and result, the
communicator as an int32 operand (a Fortran handle, ``comm.py2f()``, so each
local device can use its own communicator without a ``lax.switch``) and an
``active`` int32 operand: 0 returns at once and leaves the buffers untouched
(the non-leader devices of a process, with no ``lax.cond`` and no copies). The
token is created inside the computation with ``lax.create_token()``, so no
effect escapes and multi-device ``shard_map`` and ``pmap`` accept it. One token
chain runs through every inter-process call of a traced step (see
``_ordering.chain_token``), so every process issues its calls in the same order.

Imports: jax, ``_mpi_load`` and ``_ordering`` (to which it registers ``native_call``).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src.interpreters import batching
from jax.extend.core import Primitive
from jax.interpreters import mlir

from . import _ordering
from ._mpi_load import _NATIVE_KINDS, native_loaded, require_native

# (token, comm, active, *xs) -> (token, *ys)

native_p = Primitive("jaxsync_native")
native_p.multiple_results = True


def _drop_varying(aval, axes):
    """``aval`` typed invariant over ``axes`` (shard_map axes of size 1)."""
    mat = getattr(aval, "manual_axis_type", None)
    if not axes or mat is None or not (mat.varying & set(axes)):
        return aval
    return aval.update(
        manual_axis_type=_core.ManualAxisType(
            varying=mat.varying - set(axes), unreduced=mat.unreduced, reduced=mat.reduced
        )
    )


def _native_abstract_eval(token, comm, active, *xs, kind, size, invariant, inplace=True, **_):
    del token, comm, active  # the other parameters only reach the lowering
    outs = []
    kind = kind.removesuffix("_async") if kind.startswith("all") else kind
    for x in xs:
        if kind == "alltoall" and (x.ndim == 0 or x.shape[0] != size):
            raise ValueError(
                f"jaxsync: the native all-to-all needs an operand whose leading axis "
                f"has the communicator's size {size} (one row per process), got shape "
                f"{tuple(x.shape)}. Fix: reshape it to ({size}, ...)."
            )
        if kind == "allgather":
            spec = x.sharding.spec
            sharding = x.sharding.update(spec=type(spec)(None, *spec))
            out = x.update(shape=(size, *x.shape), sharding=sharding)
        elif kind == "reduce_scatter" and not inplace:  # 1-D: this rank's slice
            out = x.update(shape=(-(-x.shape[0] // size),))
        else:
            out = x.update(shape=x.shape)
        outs.append(out if kind == "alltoall" else _drop_varying(out, invariant))
    return (_core.abstract_token, *outs)


native_p.def_abstract_eval(_native_abstract_eval)

# Kinds whose results are aliased to their inputs (unless ``inplace=False``) and
# that take ``group_bytes``.
_IN_PLACE = ("allreduce", "allreduce_async", "reduce", "bcast")
# Blocking kinds that take ``poll_us`` (besides allreduce): how they wait.
_POLLED = ("allgather", "alltoall", "allgather_async", "alltoall_async", "reduce_scatter")
# The host tier in one call (``jaxsync_tier``, registered by ``tier_available``):
# ``chunk`` > 0 bytes a chunk, leader_only; < 0: two_dimensional.
_KINDS = (*_NATIVE_KINDS, "tier")
native_p.def_impl(functools.partial(_dispatch.apply_primitive, native_p))


def _native_lowering(
    ctx,
    token,
    comm,
    active,
    *xs,
    kind,
    size,
    invariant,
    agree,
    group,
    inplace=True,
    poll=0,
    chunk=0,
    piece=0,
):
    del size, invariant
    if (
        kind in _IN_PLACE + ("reduce_scatter",) and inplace
    ) or kind == "tier":  # result i is operand 3 + i
        aliases = {3 + i: 1 + i for i in range(len(xs))}
    else:
        aliases = None
    rule = jax.ffi.ffi_lowering(f"jaxsync_{kind}", operand_output_aliases=aliases)
    i64 = np.int64
    if kind in ("allreduce", "allreduce_async"):
        attrs = dict(group_bytes=i64(group), piece_bytes=i64(piece), poll_us=i64(poll))
    elif kind in _IN_PLACE:
        attrs = dict(group_bytes=i64(group))
    elif kind in _POLLED:
        attrs = dict(poll_us=i64(poll))
    elif kind == "tier":
        attrs = dict(chunk_bytes=i64(abs(chunk)), leader_only=i64(chunk > 0), poll_us=i64(poll))
    elif kind in ("agree", "step"):
        names = ("agree_comm", "agree_id", "agree_instance", "agree_devices", "agree_site")
        attrs = {k: i64(v) for k, v in zip(names, agree)}
        # Kept and never merged by XLA: each counts a step on every run.
        rule = jax.ffi.ffi_lowering(f"jaxsync_{kind}", has_side_effect=True)
    else:
        attrs = {}
    return rule(ctx, token, comm, active, *xs, **attrs)


mlir.register_lowering(native_p, _native_lowering, platform="cpu")


def _native_batching(args, dims, **params):
    # Under vmap every mapped replica takes part as a slice of one larger message.
    token, comm, active, *xs = args
    kind = params["kind"].removesuffix("_async")
    nm = None  # not mapped
    if any(d is not nm for d in dims[:3]):
        raise NotImplementedError(
            "jaxsync: the communicator and the active flag of an MPI call cannot "
            "be batched (vmap them outside the synchronisation)"
        )
    xdims = dims[3:]
    if kind in ("reduce_scatter", "tier"):
        raise NotImplementedError(
            f"jaxsync: the host tier's {kind} is not batched (under vmap the "
            "synchronisation uses the world communicator)"
        )
    if kind == "alltoall":  # the leading (peer) axis must stay first
        xs = [x if d is nm else jax.numpy.moveaxis(x, d, 1) for x, d in zip(xs, xdims)]
        xdims = [d if d is nm else 1 for d in xdims]
    outs = native_p.bind(token, comm, active, *xs, **params)
    if kind == "allgather":
        xdims = [d if d is nm else d + 1 for d in xdims]
    return outs, (nm, *xdims)


batching.primitive_batchers[native_p] = _native_batching


GROUP_BYTES = 64 * 2**10
"""Default of ``native_call``'s ``group``: buffers under it are summed together."""


def native_call(
    kind,
    xs,
    token,
    comm,
    active,
    size,
    invariant=(),
    agree=(0, 0, 1, 1, -1),
    group=GROUP_BYTES,
    inplace=True,
    poll=0,
    chunk=0,
    piece=0,
):
    """Bind one native collective: returns ``(token, [results])``.

    Args:
      kind: ``"allreduce"`` (sum of every buffer of ``xs``, in place),
        ``"allreduce_async"`` (the same sum on the communicator's thread: XLA
        runs on until a result is used),
        ``"allgather"`` (each buffer stacked along a new leading axis of size
        ``size``; any number, one call), ``"alltoall"`` (buffers whose leading
        axis has size ``size``), ``"allgather_async"`` / ``"alltoall_async"``
        (the same on the communicator's thread), ``"reduce"`` (sums onto rank
        0, in place there; other ranks' buffers unchanged), ``"bcast"`` (rank
        0's buffers to every rank, in place) or ``"reduce_scatter"`` (1-D
        buffers: this rank's slice of ``ceil(n / size)`` elements, zeros past
        the end; in place, the buffer, the slice in its first elements, the
        rest undefined); ``reduce`` and ``reduce_scatter`` sum 16-bit floats
        in float32, rounded once.
      xs: the local arrays.
      token: the previous call's token (see ``_ordering.chain_token``).
      comm: int32 scalar: the communicator's Fortran handle (``comm.py2f()``).
      active: int32 scalar: 0 returns the inputs untouched (allreduce) or zeros.
      size: the communicator's size.
      invariant: shard_map axes of size 1 over which the results are typed
        invariant (allreduce, allgather): the sum over one member is that
        member's value, so no collective over them is needed for the type.
      agree: for ``kind="agree"`` (``xs``: a uint8 byte, an int32 scalar) and
        ``kind="step"`` (``xs``: an int32 scalar), ``(communicator handle,
        digest id, instance, devices of this process that run the check, site)``
        (see ``_mpi_load.register_agreement`` and ``MPIBackend.agree``).
      group: for ``kind="allreduce"`` (``"allreduce_async"``, ``"reduce"``,
        ``"bcast"`` alike), buffers (of one dtype, in order) under this many
        bytes are copied into one scratch buffer of at most ``max(group, 4 MiB)``
        bytes and summed by one MPI call (``flat`` passes its ``bucket_bytes``:
        one message per bucket, packed by the target).
      inplace: for these kinds and ``reduce_scatter``, results aliased to the
        inputs (``MPI_IN_PLACE``);
        ``False`` writes fresh results (an input XLA must keep, such as a
        parameter of the step, is then read where it is instead of copied).
      poll: how the call waits for its MPI calls (for ``kind="allreduce_async"``,
        the communicator's thread; every kind but ``reduce``, ``bcast`` and
        ``agree``, which spin): 0 spins in ``MPI_Wait``; ``> 0`` tests in a
        loop for 1 ms, yielding the core between tests (a call that ends within
        that is not held up), then sleeps between tests an eighth of the time
        waited, at most this many microseconds (the cores stay with the step's
        compute and the host's other processes).
      piece: for ``kind="allreduce"`` and ``"allreduce_async"``, ``> 0``: no MPI
        call sums more than this many bytes (larger buffers are cut into pieces,
        at most 2 in flight; see ``_mpi_ops.PIECE_BYTES``); 0: one call per
        buffer (up to MPI's int count), all in flight at once.
      chunk: for ``kind="tier"`` (``comm``, ``active``: int32[2], the host's
        and the cross communicator's), bytes a chunk: ``> 0`` leader_only
        (reduce, allreduce, broadcast), ``< 0`` two_dimensional (reduce-scatter,
        allreduce, all-gather); see ``_mpi_ops._NativeOps.pipelined``.
    """
    assert kind in _KINDS, kind
    require_native()
    if kind == "tier" and not tier_available():
        raise RuntimeError("jaxsync: the native library has no jaxsync_tier (rebuild it)")
    token, *ys = native_p.bind(
        token,
        comm,
        active,
        *xs,
        kind=kind,
        size=int(size),
        invariant=tuple(invariant),
        agree=tuple(int(a) for a in agree),
        group=int(group),
        inplace=bool(inplace),
        poll=int(poll),
        chunk=int(chunk),
        piece=int(piece),
    )
    return token, ys


@functools.cache
def tier_available() -> bool:
    """Whether the native library has ``jaxsync_tier`` (registered here, once)."""
    from . import _mpi_load

    lib = _mpi_load._native()
    if not hasattr(lib, "jaxsync_tier"):
        return False  # a library built before it: the tier's three calls
    jax.ffi.register_ffi_target("jaxsync_tier", jax.ffi.pycapsule(lib.jaxsync_tier), platform="cpu")
    return True


def _threads_chains() -> bool:
    """Whether the native calls thread the chains through control flow (not
    where mpi4jax's targets make the calls: ``_ordering`` ties those by data)."""
    from . import _mpi_load

    return native_loaded() and not _mpi_load.uses_mpi4jax()


_ordering.register_native(native_call, _threads_chains)

"""Ordered MPI collectives that work inside multi-device computations.

mpi4jax >= 0.8 marks its primitives with an *ordered effect*, and JAX refuses
ordered effects in any computation over more than one device. jaxsync keeps
mpi4jax's compiled XLA FFI targets (``mpi_allreduce_ffi`` and friends) but binds
them through a primitive of its own that carries an explicit XLA token as a
regular operand and result. Threading that token through every call of one
synchronisation fixes their order on every process (XLA's CPU runtime would
otherwise run independent calls in any order, and MPI would match the wrong
messages). The token is created inside the computation with
``lax.create_token()``, so no effect escapes and multi-device ``shard_map`` and
``pmap`` accept it.

Only this module touches mpi4jax internals; the supported versions are pinned in
``SUPPORTED_MPI4JAX``.
"""

from __future__ import annotations

import functools

import numpy as np

import jax
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax._src.interpreters import batching

from jax._src import core as _core
from jax._src import dispatch as _dispatch

SUPPORTED_MPI4JAX = ("0.9",)
SUPPORTED_JAX = ("0.10",)

_KINDS = ("allreduce", "allgather", "alltoall", "bcast")


class MPIUnavailableError(ImportError):
    """mpi4py or a supported mpi4jax cannot be imported."""


@functools.lru_cache(maxsize=None)
def _load():
    """Import mpi4py and mpi4jax, check versions, return helper functions."""
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - depends on install
        raise MPIUnavailableError(
            "jaxsync needs mpi4py for inter-process communication (comm=...); "
            "install it with `pip install 'jaxsync[mpi]'`, or pass comm=None."
        ) from e
    try:
        import mpi4jax  # noqa: F401  (registers the FFI targets)
        from mpi4jax._src.utils import to_dtype_handle, to_mpi_handle
    except ImportError as e:  # pragma: no cover - depends on install
        raise MPIUnavailableError(
            "jaxsync needs mpi4jax for inter-process communication (comm=...); "
            "install it with `pip install 'jaxsync[mpi]'` (see the README for "
            "building it from source), or pass comm=None."
        ) from e
    mv = ".".join(mpi4jax.__version__.split(".")[:2])
    jv = ".".join(jax.__version__.split(".")[:2])
    if mv not in SUPPORTED_MPI4JAX or jv not in SUPPORTED_JAX:
        raise MPIUnavailableError(
            f"jaxsync's MPI backend supports mpi4jax {SUPPORTED_MPI4JAX} with jax "
            f"{SUPPORTED_JAX}; found mpi4jax {mpi4jax.__version__} and jax "
            f"{jax.__version__}. Install matching versions (pip install "
            f"'mpi4jax==0.9.*' 'jax==0.10.*') or use comm=None / a mesh axis."
        )
    import atexit
    # Registered after mpi4py's MPI_Finalize handler, so it runs before it:
    # computations still in flight finish their MPI calls first.
    atexit.register(_drain)
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError(
            "jaxsync needs MPI initialised with MPI_THREAD_MULTIPLE (each local "
            f"device runs in its own thread); MPI provides level {MPI.Query_thread()}. "
            "Do not set mpi4py.rc.thread_level to a lower level."
        )
    return MPI, to_mpi_handle, to_dtype_handle


def _drain():
    try:
        for a in jax.live_arrays():
            a.block_until_ready()
    except Exception:  # pragma: no cover - interpreter shutdown
        pass


class _Hashable:
    """Wrap an MPI communicator so it can be a primitive parameter."""

    def __init__(self, comm):
        self.comm = comm

    def __hash__(self):
        return id(self.comm)

    def __eq__(self, other):
        return isinstance(other, _Hashable) and other.comm is self.comm

    def __repr__(self):
        return f"Comm(size={self.comm.Get_size()})"


mpi_p = Primitive("jaxsync_mpi")
mpi_p.multiple_results = True


def _abstract_eval(x, token, *, kind, comm, root):
    del token, root
    size = comm.comm.Get_size()
    shape = (size, *x.shape) if kind == "allgather" else x.shape
    # Keep shard_map's manual-axis types of the input (a per-device value).
    if kind == "allgather":
        spec = x.sharding.spec
        sharding = x.sharding.update(spec=type(spec)(None, *spec))
        out = x.update(shape=shape, sharding=sharding)
    else:
        out = x.update(shape=shape)
    return (out, _core.abstract_token)


mpi_p.def_abstract_eval(_abstract_eval)
mpi_p.def_impl(functools.partial(_dispatch.apply_primitive, mpi_p))


def _lowering(ctx, x, token, *, kind, comm, root):
    MPI, to_mpi_handle, to_dtype_handle = _load()
    x_aval = ctx.avals_in[0]
    n = np.int64(np.prod(x_aval.shape, dtype=np.int64))
    dtype = np.int64(to_dtype_handle(x_aval.dtype))
    c = np.int64(to_mpi_handle(comm.comm))
    if kind == "allreduce":
        attrs = dict(nitems=n, op=np.int64(to_mpi_handle(MPI.SUM)), comm=c, dtype=dtype)
    elif kind == "allgather":
        attrs = dict(sendcount=n, sendtype=dtype, recvcount=n, recvtype=dtype, comm=c)
    elif kind == "alltoall":
        per = np.int64(n // comm.comm.Get_size())
        attrs = dict(sendcount=per, sendtype=dtype, recvcount=per, recvtype=dtype, comm=c)
    elif kind == "bcast":
        attrs = dict(nitems=n, root=np.int64(root), comm=c, dtype=dtype)
    else:  # pragma: no cover
        raise ValueError(kind)
    rule = jax.ffi.ffi_lowering(f"mpi_{kind}_ffi", has_side_effect=True)
    return rule(ctx, x, token, **attrs)


mlir.register_lowering(mpi_p, _lowering)


def _batching(args, dims, **params):
    # Under vmap every mapped replica takes part as a slice of one larger message.
    x, token = args
    xd, _ = dims
    nm = None  # batching.not_mapped
    if xd is nm:
        return mpi_p.bind(x, token, **params), (nm, nm)
    kind = params["kind"]
    if kind == "alltoall":  # the leading (peer) axis must stay first
        x = jax.numpy.moveaxis(x, xd, 1)
        y, tok = mpi_p.bind(x, token, **params)
        return (y, tok), (1, nm)
    y, tok = mpi_p.bind(x, token, **params)
    return (y, tok), (xd + 1 if kind == "allgather" else xd, nm)


batching.primitive_batchers[mpi_p] = _batching


def call(kind, x, token, comm, root=0):
    """Bind one tokened MPI collective: returns ``(result, token)``.

    Args:
      kind: one of ``"allreduce"`` (sum), ``"allgather"`` (stacks along a new
        leading axis of size ``comm.size``), ``"alltoall"`` (the leading axis
        must have size ``comm.size``) and ``"bcast"``.
      x: the local array.
      token: an XLA token from ``lax.create_token()`` or a previous call.
      comm: an mpi4py intra-communicator.
      root: root rank for ``"bcast"``.
    """
    assert kind in _KINDS, kind
    _load()
    return mpi_p.bind(x, token, kind=kind, comm=_Hashable(comm), root=int(root))

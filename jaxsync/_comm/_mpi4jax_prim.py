"""The mpi4jax primitive: tokened MPI collectives through mpi4jax's FFI targets.

The lowering on platforms other than CPU (``cuda``), one buffer at a time; on
CPU jaxsync uses its own targets (``_native_prim``), except in tests of the GPU
path (``JAXSYNC_TESTING_MPI4JAX=1``), which lower here to mpi4jax's CPU bridge
(the same target names, the same attributes).

Imports: jax and ``_mpi_load`` only.
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

from ._mpi_load import _load_mpi4jax

_KINDS = ("allreduce", "allgather", "alltoall", "bcast")


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


def _setup_cuda() -> None:
    """mpi4jax's CUDA set-up, which its own lowering runs first (its
    ``translation_rule_cuda``): the CUDA bridge starts handing MPI device
    pointers; this turns on staging through host memory unless
    ``MPI4JAX_USE_CUDA_MPI=1`` (a CUDA-aware MPI). Once per process (mpi4jax
    remembers), before any call is lowered."""
    from mpi4jax._src import decorators

    decorators.ensure_cuda_ext()
    decorators.setup_cuda_mpi()


def _lowering(ctx, x, token, *, kind, comm, root, cuda=True):
    MPI, to_mpi_handle, to_dtype_handle = _load_mpi4jax()
    if cuda:
        _setup_cuda()
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


mlir.register_lowering(mpi_p, _lowering, platform="cuda")
mlir.register_lowering(mpi_p, functools.partial(_lowering, cuda=False), platform="cpu")


def _batching(args, dims, **params):
    x, token = args
    xd, _ = dims
    nm = None  # not mapped
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
    """Bind one tokened mpi4jax collective (non-CPU platforms): ``(result, token)``."""
    assert kind in _KINDS, kind
    _load_mpi4jax()
    return mpi_p.bind(x, token, kind=kind, comm=_Hashable(comm), root=int(root))

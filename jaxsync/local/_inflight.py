"""Streaming's outer mean in flight across separate jitted steps (``overlap=True``).

At a fragment's send step the native target ``jaxsync_inflight_start`` copies the
pseudo-gradient (on the wire as the outer mean's ``comm_dtype`` says, divided as
the held form divides) into a buffer the native library owns (never an XLA buffer: nothing can be
donated or reused under it), queues its ``MPI_Iallreduce`` on the outer
communicator's lane (the communication thread that runs overlap's sums, jobs in
the order they were queued: the step order on every process) and returns a
handle that the optimizer state carries. ``delay`` steps later
``jaxsync_inflight_finish`` returns a future that the lane completes with the
sum: XLA:CPU runs FFI handlers that return futures asynchronously, so the step
computes while the sum lands. The transfer runs while the steps between compute
(the lane polls: it leaves the cores to them). The timeline shows it
(``allreduce_async`` on the lane), and the exit drain waits for it (the native
call counters).

A checkpoint taken while a fragment is in flight saves its sum and resumes with
it (``_resume``: a handle is a number of this process, meaningless in another).

May import: JAX, numpy, mpi4py (lazily), ``jaxsync._comm`` (``_mpi_load``,
``_mpi_ops``, ``_timeline``).
"""

from __future__ import annotations

import ctypes
import functools

import jax
import jax.numpy as jnp
import numpy as np

_START, _FINISH = "jaxsync_inflight_start", "jaxsync_inflight_finish"


@functools.cache
def _lib():
    """The native library, with the in-flight targets registered (once)."""
    from jaxsync._comm import _mpi_load

    _mpi_load.require_native()
    lib = _mpi_load._native()
    for name in (_START, _FINISH):
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
    lib.jaxsync_inflight_size.restype = ctypes.c_int64
    lib.jaxsync_inflight_size.argtypes = [ctypes.c_int32]
    lib.jaxsync_inflight_wait.restype = ctypes.c_int
    lib.jaxsync_inflight_wait.argtypes = [
        ctypes.c_int32,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_char_p,
        ctypes.c_int64,
        ctypes.POINTER(ctypes.c_float),
    ]
    lib.jaxsync_inflight_put.restype = ctypes.c_int32
    lib.jaxsync_inflight_put.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float]
    lib.jaxsync_inflight_fail_all.restype = ctypes.c_int64
    lib.jaxsync_inflight_fail_all.argtypes = [ctypes.c_char_p]
    lib.jaxsync_inflight_pending.restype = ctypes.c_int64
    return lib


class Lane:
    """The outer communicator's in-flight sums: jaxsync's own duplicate of it
    (``comm``, never the user's handle), its size, and how its lane waits."""

    def __init__(self, comm):
        from jaxsync._comm import _mpi_ops, _timeline

        _lib()
        self.comm = comm.Dup()
        self.size = self.comm.Get_size()
        self.handle = int(self.comm.py2f())
        _timeline.label(self.handle, "islands' outer mean (in flight)")
        # Its peers are other islands: across hosts in the intended use (poll, in
        # pieces, as overlap's sums there); a world of one host spins (shared memory).
        names = self.comm.allgather(_hostname())
        spans = len(set(names)) > 1
        self.poll = _mpi_ops.LANE_POLL_US if spans else 0
        self.piece = _mpi_ops.PIECE_BYTES if spans else 0


def _hostname() -> str:
    import socket

    return socket.gethostname()


_LANES: dict = {}


def lane(comm) -> Lane:
    """The lane of ``comm`` (made once, when the factory is called: collective)."""
    got = _LANES.get(id(comm))
    if got is None or got[0] is not comm:
        got = _LANES[id(comm)] = (comm, Lane(comm))
    return got[1]


def _travel(sync) -> tuple:
    """The wire dtype (``comm_dtype``: bfloat16 / float16 or float32) and the
    factor divided out before the sum, as the held form's ``sync`` has them."""
    from jaxsync._core import _sync

    travel = jnp.dtype(sync.comm_dtype) if sync.comm_dtype else jnp.dtype(jnp.float32)
    return travel, _sync._predivide(sync, travel, sync.backend.size())


def start(ln: Lane, sync, leaves) -> jax.Array:
    """Start the mean of ``leaves`` (float32) across the lane, on the wire as
    ``sync`` (the outer mean's config) says; its handle (int32)."""
    from jaxsync._core import _sync

    travel, pre = _travel(sync)
    flat = jnp.concatenate([x.reshape(-1) for x in leaves]).astype(travel)
    flat = _sync._scale_before(flat, pre)
    call = jax.ffi.ffi_call(_START, jax.ShapeDtypeStruct((), jnp.int32), has_side_effect=True)
    post = ln.size / pre if sync.reduce == "mean" else 1.0 / pre
    attrs = dict(poll_us=np.int64(ln.poll), piece_bytes=np.int64(ln.piece))
    return call(flat, comm=np.int64(ln.handle), post=np.float32(post), **attrs)


def finish(ln: Lane, sync, handle, like) -> list:
    """Take ``handle``'s sum (waiting for it); the mean, float32 leaves shaped like
    ``like``: divided after the sum as the held form's ``sync`` divides, by the
    divisor given at its start (its own world's, also for a sum resumed after a
    recovery in a smaller one; exact where it is 1)."""
    travel, _ = _travel(sync)
    size = sum(int(np.prod(x.shape)) for x in like)
    shapes = (jax.ShapeDtypeStruct((size,), travel), jax.ShapeDtypeStruct((), jnp.float32))
    flat, post = jax.ffi.ffi_call(_FINISH, shapes, has_side_effect=True)(handle)
    flat = flat.astype(jnp.float32) / post
    out, at = [], 0
    for x in like:
        k = int(np.prod(x.shape))
        out.append(flat[at : at + k].reshape(x.shape))
        at += k
    return out


def fail_all(text: str) -> int:
    """Fail every sum in flight with ``text`` (a finish waiting on one raises it at
    once); how many. For :func:`jaxsync.elastic.run`'s recovery."""
    return int(_lib().jaxsync_inflight_fail_all(text.encode()))

"""The ops an inter-process stage hands to a strategy, one class per transport.

``_NativeOps``: jaxsync's native FFI targets on CPU (``_native_prim``; inside
``_async.asynchronous()`` the asynchronous allreduce); ``_MPIOps``: mpi4jax's
(GPUs); ``_HostOps``: host staging through mpi4py in ``io_callback``s. Each call
takes the token (or host dependency) of the previous one (``_ordering``), so
every process issues them in one order. Made by ``_mpi_backend.MPIBackend``.

Imports: ``_native_prim``, ``_mpi4jax_prim``, ``_ordering``, ``_async``, ``_tie``;
none of them imports it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from . import _async, _mpi4jax_prim, _native_prim, _ordering
from ._tie import tie

# How a native call over a communicator that spans hosts waits for its MPI
# requests (the communication thread's sums, and since the blocking calls too:
# a sum without overlap, sharded's reduce-scatter and all-gathers, which spun:
# sharded's step kept the cores 99% busy on the emulated cluster at 1 Gb/s where
# the chain's polled sum took 21-32%): the wait of Poll in mpi_ffi.cc, which
# tests and yields the core for 1 ms, then sleeps between tests an eighth of the
# time waited, at most this many microseconds. The network sets the pace there,
# and a spinning thread takes a core from the step's compute it overlaps: on the
# emulated cluster (2 hosts at 1 Gb/s, 2 cores) overlap=True took 285 ms a step
# polling and 343 spinning, double_buffering=True 226 and 260
# (docs/benchmarks.md). Within a host (shared memory) the thread spins: the
# copies need the CPU. The pipelined host tier (jaxsync_tier, which always spans
# hosts) polls the same way: spinning, every process of the emulated hosts kept
# the 2 cores busy (100% against 20% for the sums that poll) at 100 Mb/s.
LANE_POLL_US = 100

# The largest sum one MPI call makes on a communicator that spans hosts: a larger
# buffer is cut into pieces of this many bytes, and the native target keeps at
# most 2 sums in flight there (kPiecesInFlight), each new one waiting for the
# oldest. Measured on the emulated cluster at 100 Mb/s (wire-bound), the
# ResNet-like tree's 22 MB as mpi4py MPI_Iallreduces, interleaved in one run,
# medians of 5 against the link's limit: at 2 hosts x 4 processes pieces of 2 MiB /
# 768 / 512 / 256 KiB, at most 2 in flight, 1.069x / 1.039x / 1.013x / 1.006x
# (2 x 2: 1.059x / 1.015x / 1.008x / 1.007x; 2 x 1: 1.014x / 1.038x / 1.014x /
# 1.006x); 512 KiB with 1 / 2 / 4 / 8 in flight 1.006x / 1.013x / 1.030x / 1.083x
# at 2 x 4. Over MPICH's own allreduce of every process, pieces above 512 KiB
# leave the wire idle part of the time when a host has several processes. The
# native sum of hierarchical_mean, in one run: 2 x 4 1.093x (2 MiB) / 1.038x
# (512 KiB), transformer-like 1.029x / 1.023x, 2 x 2 1.049x / 1.024x; at 1 Gb/s
# (2 x 2, CPU-bound) the same (1.13x / 1.12x). Earlier, at 2 x 2 with 2 MiB
# pieces: one buffer 1.20x (spread 1.04-1.47x), the leaves all in flight 1.10x,
# 2 MiB pieces with 1 / 2 / 4 / all in flight 1.041x / 1.030x / 1.066x / 1.109x.
# Within a host (shared memory) nothing changes.
PIECE_BYTES = 512 << 10

# The host tier's chunk (bytes of a buffer's elements; see _NativeOps.pipelined):
# a synchronisation of more bytes than one chunk runs its three stages at once
# over consecutive chunks (jaxsync_tier). Measured on the emulated cluster,
# hierarchical_mean with bfloat16 on the wire (the ResNet-like tree, one run each,
# medians of 5-7 against the float32 link limit), 2 MiB / 1 MiB / 512 KiB chunks:
# 2 hosts x 4 processes at 100 Mb/s 0.617x / 0.528x / 0.542x (transformer-like
# 0.749x / 0.571x / 0.541x), 2 x 2 0.531x / 0.548x / 0.549x (within the noise:
# the least 0.526x / 0.508x / 0.504x), 2 x 2 at 1 Gb/s (CPU-bound) 0.88x / 0.66x /
# 0.65x: a smaller chunk fills and drains the pipeline sooner. Earlier, CPU-bound
# without a shaped link (4 processes faked into 2 hosts), flat float32: a 16 MiB
# leaf 38 ms in three calls -> 27 / 25 / 31 ms with 1 / 2 / 4 MiB chunks.
TIER_CHUNK_BYTES = 512 << 10


def tier_chunks(bufs, chunk_bytes, leader_only, size) -> int:
    """How many chunks ``jaxsync_tier`` cuts ``bufs`` into (as the target does):
    ``leader_only``, consecutive buffers of one dtype fill chunks of
    ``chunk_bytes // itemsize`` elements; otherwise each buffer's slice of
    ``ceil(n / size)`` elements in chunks of ``max(chunk elements // size, 1)``.

    Example:
      >>> x, y = np.zeros(10, np.float32), np.zeros(3, np.float32)
      >>> tier_chunks([x, y], 16, True, 2), tier_chunks([x, y], 16, False, 2)
      (4, 4)
    """
    count, last, fill = 0, None, 0
    for b in bufs:
        n, item = int(np.prod(b.shape)), np.dtype(b.dtype).itemsize
        cap = max(chunk_bytes // item, 1)
        if not leader_only:
            m = -(-n // size)
            count += -(-m // max(cap // size, 1))
            continue
        if n == 0:
            continue
        if b.dtype != last:
            last, fill = b.dtype, cap
        if n <= cap - fill:
            fill += n
            continue
        n -= cap - fill
        new = -(-n // cap)
        count, fill = count + new, n - (new - 1) * cap
    return count


class _NativeOps:
    """MPI collectives through jaxsync's native FFI targets, in one token chain.

    ``comm`` and ``active`` are traced int32 scalars: the communicator's
    Fortran handle and whether this device talks to the other processes (0: the
    calls return at once, buffers untouched). ``spans_hosts``: the communicator
    joins processes of several hosts (its asynchronous sums poll, see
    ``LANE_POLL_US``).
    """

    # The allreduce sums float16/bfloat16 buffers itself: all-to-all of the
    # 16-bit payload, float32 sums in rank order, one rounding, all-gather.
    sum16 = True

    def __init__(
        self, comm, active, size, invariant=(), group=_native_prim.GROUP_BYTES, spans_hosts=False
    ):
        self.comm = comm
        self.poll = LANE_POLL_US if spans_hosts else 0
        self.piece = PIECE_BYTES if spans_hosts else 0
        self.active = active
        self.size = size
        self.invariant = tuple(invariant)
        self.group = group
        self.mode = _async.ASYNC.get()  # (inplace,) inside asynchronous(), else None

    def _call(self, kind, xs, inplace=True):
        token, ys = _native_prim.native_call(
            kind,
            xs,
            _ordering.chain_token(),
            self.comm,
            self.active,
            self.size,
            self.invariant,
            group=self.group,
            inplace=inplace,
            poll=self.poll,
            piece=self.piece,
        )
        _ordering.set_chain_token(token)
        return ys

    def allreduce(self, bufs):
        if not bufs:
            return []
        if self.mode is not None:
            return self._call("allreduce_async", list(bufs), inplace=self.mode[0])
        return self._call("allreduce", list(bufs))

    def alltoall(self, x):
        return self._call("alltoall" if self.mode is None else "alltoall_async", [x])[0]

    def allgather(self, x):
        return self._call("allgather" if self.mode is None else "allgather_async", [x])[0]

    def allgather_many(self, bufs):
        """Each buffer stacked along a new leading axis: any number, one call."""
        return self._call("allgather", list(bufs)) if bufs else []

    # The host tier's steps (comm: this host's processes; rank 0 the leader).
    def reduce(self, bufs):
        return self._call("reduce", list(bufs)) if bufs else []

    def bcast(self, bufs):
        return self._call("bcast", list(bufs)) if bufs else []

    def reduce_scatter(self, bufs, inplace=False):
        """This rank's slice of each buffer; ``inplace``: the buffer itself,
        the slice in its first ``ceil(n / size)`` elements."""
        return self._call("reduce_scatter", list(bufs), inplace=inplace) if bufs else []

    def pipelined(self, cross, bufs, leader_only):
        """The host tier's sum of ``bufs`` in one call (``self``: this host's
        processes, ``cross``: this local rank's on every host), its stages at
        once over chunks of ``TIER_CHUNK_BYTES``; ``None`` where the buffers
        hold no more than one chunk's bytes (a few small buffers of several
        dtypes keep the three calls too) or the library lacks the target: the
        caller then makes the three calls. Inside ``asynchronous()`` too it runs
        where XLA calls it (its token follows the lane's jobs: no two threads on
        one communicator)."""
        chunk = TIER_CHUNK_BYTES
        nbytes = sum(int(np.prod(b.shape)) * np.dtype(b.dtype).itemsize for b in bufs)
        if nbytes <= chunk or tier_chunks(bufs, chunk, leader_only, self.size) <= 1:
            return None
        if not _native_prim.tier_available():
            return None
        token, ys = _native_prim.native_call(
            "tier",
            list(bufs),
            _ordering.chain_token(),
            jnp.stack([self.comm, cross.comm]).astype(jnp.int32),
            jnp.stack([self.active, cross.active]).astype(jnp.int32),
            self.size,
            self.invariant,
            chunk=chunk if leader_only else -chunk,
            poll=LANE_POLL_US,  # it spans hosts: its waits poll (tier_pipe.cc's Pipe::Wait)
        )
        _ordering.set_chain_token(token)
        return ys


class _MPIOps:
    """mpi4jax's collectives (non-CPU platforms), one call per buffer, chained."""

    def __init__(self, comm):
        self.comm = comm
        self.size = comm.Get_size()

    def _call(self, kind, x):
        # Inside control flow, the chain crosses by data (``_ordering.chain_after``).
        after = _ordering.chain_after()
        if after:
            x = tie(x, after=after)
        y, token = _mpi4jax_prim.call(kind, x, _ordering.chain_token(), self.comm)
        _ordering.set_chain_token(token)
        _ordering.set_chain_head(y)
        return y

    def allreduce(self, bufs):
        return [self._call("allreduce", b) for b in bufs]

    def alltoall(self, x):
        return self._call("alltoall", x)

    def allgather(self, x):
        return self._call("allgather", x)


class _HostOps:
    """Host-staged collectives: device -> host numpy -> mpi4py -> device.

    Every callback takes and returns a one-byte dependency, so the callbacks of
    one program run in program order on every process (independent callbacks
    may otherwise run in any order and MPI would match the wrong buffers). They
    are ``io_callback``s: MPI calls are side effects that JAX must neither drop
    nor repeat (it may do both with a ``pure_callback``); unordered, since JAX
    refuses ordered effects in multi-device computations - the dependency
    chain orders them.
    """

    def __init__(self, comm):
        self.comm = comm
        self.size = comm.Get_size()

    def _call(self, fn, xs, out_structs):
        def host(dep, *xs):
            del dep
            outs = fn(*[np.ascontiguousarray(x) for x in xs])
            return (*outs, np.zeros((), np.uint8))

        # One dependency chain per traced step, across synchronisations too.
        dep = _ordering.chain_value("host", lambda: jnp.zeros((), jnp.uint8))
        structs = (*out_structs, jax.ShapeDtypeStruct((), jnp.uint8))
        *ys, dep = io_callback(host, structs, dep, *xs, ordered=False)
        _ordering.set_chain_value("host", dep)
        return ys

    def allreduce(self, bufs):
        from mpi4py import MPI

        comm = self.comm

        def host_allreduce(*xs):
            outs = [np.empty_like(x) for x in xs]
            for x, out in zip(xs, outs):
                comm.Allreduce(x, out, op=MPI.SUM)
            return outs

        if not bufs:
            return []
        return self._call(
            host_allreduce, bufs, [jax.ShapeDtypeStruct(b.shape, b.dtype) for b in bufs]
        )

    def alltoall(self, x):
        comm = self.comm

        def host_alltoall(x):
            out = np.empty_like(x)
            comm.Alltoall(x.view(np.uint8), out.view(np.uint8))
            return [out]

        return self._call(host_alltoall, [x], [jax.ShapeDtypeStruct(x.shape, x.dtype)])[0]

    def allgather(self, x):
        comm = self.comm
        size = self.size

        def host_allgather(x):
            out = np.empty((size, *x.shape), x.dtype)
            comm.Allgather(x.view(np.uint8), out.view(np.uint8))
            return [out]

        return self._call(host_allgather, [x], [jax.ShapeDtypeStruct((size, *x.shape), x.dtype)])[0]

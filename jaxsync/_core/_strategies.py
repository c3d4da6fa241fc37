"""Strategies: short compositions of an intra stage and an inter stage.

Each strategy maps a list of 1-D buffers (one per bucket, summed over every
replica) to their sums. It never knows whether the inter-process stage is MPI,
a mesh axis or absent: it only calls ``backend.run`` with a program that uses
the ``ops`` it is given.

=================  ======================================  ============================
strategy           intra stage                             inter stage
=================  ======================================  ============================
naive              one sum per leaf                        leader: one allreduce per leaf
flat               one sum of all buffers                  leader: one allreduce per buffer
hierarchical       one sum of all buffers                  leader: one allreduce per buffer
two_dimensional    reduce-scatter                          every device its slice; all-gather
single_node        sum                                     none
=================  ======================================  ============================

"leader" means local device 0 talks to the other processes and the result is
broadcast over the local axes. With jaxsync's native MPI targets (CPU) all
buffers of one inter stage go to MPI in one call, and with a single local
device there is no intra stage at all. ``flat`` packs every leaf into one buffer
per dtype (ChainerMN's flat communicator; with the native target and one device
per process the target packs them, into a reused scratch buffer, so XLA
neither concatenates nor slices); ``hierarchical`` sends large leaves as they
are, without a copy, and packs only the small ones.

flat, hierarchical and two_dimensional may ask for a *tiered* inter stage
(their ``host_tier`` option, see ``_host_tier.chosen``): a backend whose
processes share hosts then reduces over the processes of a host first and runs
the program over the hosts (the MPI backend's host tier:
leader_only, the host's leader; otherwise, each local rank's slice); the
strategy never sees how.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ._plan import concat
from ._reduce16 import rows_sum_f32

STRATEGIES = ("naive", "flat", "hierarchical", "two_dimensional", "single_node")

_LOW = ("float16", "bfloat16")


def _uint_view(x):
    return lax.bitcast_convert_type(x, jnp.uint16)


def _from_uint(x, dtype):
    return lax.bitcast_convert_type(x, jnp.dtype(dtype))


def sum_buffers(ops, bufs: list) -> list:
    """Sum each buffer over ``ops``'s group.

    32/64-bit buffers use one allreduce. 16-bit buffers are never summed in 16
    bits. Inside a process (``ops.wire16`` false) they are summed as float32 by
    one XLA all-reduce and rounded once. Across processes the 16-bit payloads
    travel as they are: all 16-bit buffers of a dtype are concatenated, go through
    one all-to-all, every member sums its slice in float32 and rounds once, and
    one all-gather returns the slices (ChainerMN's inter-node step). MPI has no
    16-bit float type; the payload travels bit-cast to uint16. jaxsync's native
    MPI target (``ops.sum16``) does the same step inside its one allreduce call,
    with the same bits.
    """
    out = list(bufs)
    if not getattr(ops, "axes", True):  # no local axes: nothing to sum over
        return out
    if getattr(ops, "sum16", False):
        # jaxsync's native allreduce does ChainerMN's step below itself, in one
        # call for every buffer (16-bit ones included), without XLA copies.
        return ops.allreduce(out)
    low = [i for i, b in enumerate(bufs) if str(b.dtype) in _LOW]
    if not getattr(ops, "wire16", True):
        wide = list(range(len(bufs)))
        sent = [b.astype(jnp.float32) if i in low else b for i, b in enumerate(bufs)]
        for i, y in zip(wide, ops.allreduce(sent)):
            out[i] = y.astype(bufs[i].dtype)
        return out
    wide = [i for i in range(len(bufs)) if i not in low]
    for i, y in zip(wide, ops.allreduce([bufs[i] for i in wide])):
        out[i] = y
    for dtype in dict.fromkeys(str(bufs[i].dtype) for i in low):
        idx = [i for i in low if str(bufs[i].dtype) == dtype]
        sizes = [bufs[i].shape[0] for i in idx]
        packed = bufs[idx[0]] if len(idx) == 1 else concat([bufs[i] for i in idx])
        total = _sum_low(ops, packed)
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        for i, a, b in zip(idx, offsets, offsets[1:]):
            out[i] = total if len(idx) == 1 else lax.slice(total, (a,), (b,))
    return out


def _sum_low(ops, x):
    size = ops.size
    if size == 1:
        return x
    dtype = x.dtype
    n = x.shape[0]
    m = -(-n // size)
    xp = jnp.pad(x, (0, m * size - n)).reshape(size, m)
    got = _from_uint(ops.alltoall(_uint_view(xp)), dtype)  # (size, m)
    part = rows_sum_f32(got).astype(dtype)  # my slice
    full = _from_uint(ops.allgather(_uint_view(part)), dtype)  # (size, m)
    return full.reshape(-1)[:n]


def _pad_to(x, k):
    n = x.shape[0]
    m = -(-n // k) * k
    return jnp.pad(x, (0, m - n)), n


def run(strategy: str, bufs: list, intra, backend, group_bytes=None, tiered=False) -> list:
    """Sum ``bufs`` over every replica: intra axes x processes.

    ``group_bytes``: for jaxsync's native MPI target, buffers under this size
    are packed by the target into messages of up to that size (``flat`` with
    one device per process hands it the leaves unpacked; see ``_sync``).
    ``tiered``: ``flat``, ``hierarchical`` and ``two_dimensional`` may take the
    backend's host tier (the ``host_tier`` option, decided by ``_sync``).
    """
    if strategy == "single_node":
        return sum_buffers(intra, bufs)
    if strategy == "naive":
        # One intra reduction per leaf, then one inter reduction per leaf; the
        # inter calls share one ordered program so every process issues them in
        # the same order.
        bufs = [sum_buffers(intra, [b])[0] for b in bufs]
        per_leaf = lambda ops, bs: [sum_buffers(ops, [b])[0] for b in bs]
        return backend.run(per_leaf, bufs, intra, leader_only=True)
    if strategy in ("flat", "hierarchical"):
        # Same stages; they differ in packing (flat: everything packed).
        bufs = sum_buffers(intra, bufs)
        return backend.run(
            sum_buffers, bufs, intra, leader_only=True, group_bytes=group_bytes, tiered=tiered
        )
    if strategy == "two_dimensional":
        d = intra.size
        padded = [_pad_to(b, d) for b in bufs]
        slices = [_scatter_sum(intra, x) for x, _ in padded]
        slices = backend.run(sum_buffers, slices, intra, leader_only=False, tiered=tiered)
        return [intra.allgather_tiled(s)[:n] for s, (_, n) in zip(slices, padded)]
    raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")


def _scatter_sum(intra, x):
    """Reduce-scatter over the intra axes, accumulating 16-bit data in float32."""
    if str(x.dtype) not in _LOW or intra.size == 1:
        return intra.reduce_scatter(x)
    if not intra.wire16:
        return intra.reduce_scatter(x.astype(jnp.float32)).astype(x.dtype)
    d = intra.size
    got = _from_uint(intra.alltoall(_uint_view(x.reshape(d, -1))), x.dtype)
    return rows_sum_f32(got).astype(x.dtype)

"""What each strategy issues, and the predicted time of a whole synchronisation.

What it is for: :func:`strategy_ops` lists the collectives, local copies and
per-leaf work that each of jaxsync's strategies issues for a packing plan (its
buckets) and a topology, following ``_strategies.run``, ``_sync.sync``
(which plans leaves one buffer each when one device per process hands them to
the native MPI target) and the native target itself (it copies buffers under
64 KiB of one dtype - for ``flat`` alone, under ``bucket_bytes`` - into one
scratch buffer and sends that as one message); :func:`predict` prices them with
a :class:`jaxsync.auto._cost.Profile`, adding the strategy's calibrated overhead per
leaf and per byte.

May import: the standard library and ``jaxsync.auto._cost`` (no JAX).

Example:
  >>> from jaxsync.auto._cost_ops import BucketInfo, ModelTopology, predict
  >>> topo = ModelTopology(processes=2, hosts=1, local_devices=4)
  >>> b = [BucketInfo("float32", 4 * 2**20, 3)]
  >>> predict("two_dimensional", b, topo) < predict("naive", b, topo)
  True
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence

from ._cost import (
    DEFAULT_PROFILE,
    NATIVE_GROUP_BYTES,
    NATIVE_SMALL_BYTES,
    STRATEGY_NAMES,
    Profile,
    collective_seconds,
)

# Across hosts the native target sums a buffer in calls of at most PIECE_BYTES, two
# in flight (_mpi_ops.PIECE_BYTES, kPiecesInFlight); the host tier runs its three
# stages at once over chunks of TIER_CHUNK_BYTES (_mpi_ops, jaxsync_tier).
PIECE_BYTES, PIECES_IN_FLIGHT, TIER_CHUNK_BYTES = 512 << 10, 2, 512 << 10

FLAT_GROUP_BYTES = 4 << 20
"""``flat_mean``'s default ``bucket_bytes``: with one device per process the
native target packs every leaf into messages of up to this size."""


def strategy_defaults(strategy: str) -> tuple[int | None, int | None]:
    """``(bucket_bytes, pack_threshold)`` of the strategy's factory (its defaults
    in ``_config.make_config``: ``flat`` packs everything into 4 MiB
    buckets, the others leave leaves of 256 KiB and more unpacked in 64 MiB)."""
    if strategy == "flat":
        return FLAT_GROUP_BYTES, None
    return 64 << 20, 256 << 10


MIN_SHARE = 0.1
"""A prediction is never below this share of its collectives and copies (a
negative fitted overhead must not make a sync free)."""


@dataclasses.dataclass(frozen=True)
class BucketInfo:
    """One buffer of a plan: its dtype, bytes and how many leaves it packs."""

    dtype: str
    nbytes: int
    leaves: int = 1

    @property
    def itemsize(self) -> int:
        return 2 if self.dtype in ("float16", "bfloat16") else (8 if self.dtype == "float64" else 4)


@dataclasses.dataclass(frozen=True)
class ModelTopology:
    """What the model needs to know about where a synchronisation runs.

    Attributes:
      processes: members of the inter-process stage (1: none).
      hosts: hosts they span (the inter link is ``"host"`` for 1, else
        ``"network"``).
      local_devices: replicas per process (the intra stage's size).
      native: MPI through jaxsync's native target (CPU): small buffers of a
        dtype travel in one message, and with one device per process
        ``hierarchical``/``two_dimensional`` hand leaves over unpacked.
      broadcast: the inter stage runs on local device 0 and its result is
        broadcast over the local devices (MPI); ``False`` for a mesh axis.
      inter_link: override the inter link (e.g. ``"device"`` for a simulated
        host axis in one process).
      host_tier: whether ``flat``, ``hierarchical`` and ``two_dimensional`` reduce
        over the processes of a host first (``_mpi_backend.MPIBackend.tier``),
        with several hosts and several processes on a host: ``True``,
        ``False``, or ``"auto"`` (for a mostly 16-bit wire, see :meth:`tiers`);
        ``None``: what the native target does by default (the factories'
        ``"auto"`` after ``JAXSYNC_HOST_TIER``).
      staging: ``"host"``: the inter stage's buffers go to host memory and back
        (``staging="host"``; mpi4jax without CUDA-aware MPI), priced at the
        profile's ``stage`` (else ``copy``) per byte; ``"device"``: not.
    """

    processes: int = 1
    hosts: int = 1
    local_devices: int = 1
    native: bool = True
    broadcast: bool = True
    inter_link: str | None = None
    host_tier: bool | str | None = None
    staging: str = "device"

    @property
    def link(self) -> str:
        if self.inter_link:
            return self.inter_link
        return "host" if self.hosts <= 1 else "network"

    def tiers(self, wire16: bool = False) -> bool:
        """The host tier is in use (processes of a host, then hosts) for a sync
        most of whose bytes are 16-bit on the wire (``wire16``) or not: the rule
        of ``_host_tier.chosen``.

        Example:
          >>> t = ModelTopology(processes=4, hosts=2, host_tier="auto")
          >>> t.tiers(wire16=True), t.tiers(wire16=False), t.tiered
          (True, False, False)
        """
        option = self.host_tier
        if option is None:  # the native target's default: "auto" after the override
            env = os.environ.get("JAXSYNC_HOST_TIER", "").strip()  # _host_tier.override
            option = {"1": True, "0": False}.get(env, "auto")
            option = option if self.native and self.broadcast else False
        return 1 < self.hosts < self.processes and (wire16 if option == "auto" else bool(option))

    @property
    def tiered(self) -> bool:
        """The host tier is in use for a float32 (not mostly 16-bit) wire."""
        return self.tiers(False)

    @property
    def per_host(self) -> int:
        """Processes per host (the host tier's members)."""
        return -(-self.processes // max(1, self.hosts))


@dataclasses.dataclass(frozen=True)
class Op:
    """Collectives of one kind issued at one stage (one message per size)."""

    stage: str  # "intra", "host" (the host tier), "inter", "local"
    kind: str  # a collective, "copy", "leaf", "strategy" or "strategy16" (overheads)
    link: str  # for "strategy": the strategy's name
    members: int
    sizes: tuple  # bytes of each message (whole buffer per member)
    flows: int = 1
    calls: int = 1  # separate calls (ops) that send these messages
    piece: int = 0  # > 0: each message cut into calls of at most this, 2 in flight
    chunks: int = 0  # > 1: a stage of the host tier's pipeline over this many chunks

    def seconds(self, profile: Profile) -> float:
        if self.kind == "copy":
            return profile.copy * float(sum(self.sizes))
        if self.kind == "stage":  # device -> host -> device
            return (profile.stage or profile.copy) * float(sum(self.sizes))
        if self.kind == "leaf":
            return profile.leaf * float(sum(self.sizes))
        if self.kind == "strategy":  # sizes: (leaves, bytes of the tree)
            per_leaf, per_byte = profile.overhead(self.link)
            return per_leaf * self.sizes[0] + per_byte * self.sizes[1]
        if self.kind == "strategy16":  # sizes: (bytes of 16-bit data,)
            return profile.overhead16(self.link) * self.sizes[0]
        link = profile.link(self.link)

        def one(s):
            return collective_seconds(self.kind, s, self.members, link, "link", flows=self.flows)

        # pieces of `piece` bytes, PIECES_IN_FLIGHT at once: the bytes cost as one
        # message; each further piece adds its latency, overlapped with another's
        extra = [(-(-s // self.piece) - 1) for s in self.sizes] if self.piece else [0]
        total = sum(one(s) for s in self.sizes) + sum(extra) * one(1) / PIECES_IN_FLIGHT
        return self.calls * link.call + total


def _native_messages(
    sizes: Iterable[tuple[str, int]], group: int = NATIVE_SMALL_BYTES
) -> tuple[list[int], int]:
    """Messages of one native allreduce call, and the bytes it copies into (and
    out of) its scratch buffers: buffers of at least ``group`` bytes alone, the
    smaller ones of a dtype grouped, in order, into messages of up to
    ``max(group, NATIVE_GROUP_BYTES)`` (mpi_ffi.cc's Group)."""
    cap = max(group, NATIVE_GROUP_BYTES)
    out: list[int] = []
    groups: dict = {}
    for dtype, n in sizes:
        if n >= group:
            out.append(n)
            continue
        g = groups.setdefault(dtype, [])
        if g and g[-1][0] + n <= cap:
            g[-1] = (g[-1][0] + n, g[-1][1] + 1)
        else:
            g.append((n, 1))
    copied = 0
    for g in groups.values():
        out += [n for n, _ in g]
        copied += sum(n for n, k in g if k > 1)
    return out, copied


def per_leaf_plan(strategy: str, topo: ModelTopology, wire16: bool = False) -> bool:
    """Whether ``_sync`` plans this strategy one buffer per leaf (``two_dimensional``
    over the host tier packs: its slices are cut from buffers, not leaves);
    ``wire16``: most of the sync's bytes are 16-bit on the wire."""
    if strategy == "two_dimensional" and topo.tiers(wire16):
        return False
    return strategy == "naive" or (
        _alone(topo) and strategy in ("hierarchical", "two_dimensional", "flat")
    )


def _alone(topo: ModelTopology) -> bool:
    """One device per process and the native target: leaves go to it unpacked."""
    return topo.local_devices == 1 and topo.native and topo.processes > 1


def strategy_ops(
    strategy: str,
    buckets: Sequence[BucketInfo],
    topo: ModelTopology,
    comm_itemsize: int | None = None,
    bucket_bytes: int | None = FLAT_GROUP_BYTES,
) -> list[Op]:
    """The collectives and copies ``strategy`` issues for ``buckets``.

    ``buckets`` is the plan ``_sync`` makes for this strategy (see
    :func:`per_leaf_plan`); ``comm_itemsize`` the bytes per element on the wire
    when ``comm_dtype`` is set; ``bucket_bytes`` is ``flat``'s (with one device per
    process, the native target's group size). Mirrors ``_strategies.run``: 16-bit buffers are
    summed as float32 inside a process and travel as 16 bits through an
    all-to-all and an all-gather across processes (with the native target
    between two processes: in its allreduce, like the others). With the host
    tier (``topo.tiers``) ``flat`` and ``hierarchical`` add a reduce onto the
    host's leader and a broadcast from it (``"host"`` stage and link, float32
    for 16-bit data) around the allreduce among the hosts' leaders;
    ``two_dimensional`` a reduce-scatter and an all-gather over the host around
    the allreduce of each local rank's slice with its peers on other hosts.
    """
    if strategy not in STRATEGY_NAMES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGY_NAMES}")
    D, P = topo.local_devices, topo.processes
    if strategy == "single_node":
        P = 1
    items = []
    for b in buckets:
        isz = comm_itemsize or b.itemsize
        elems = b.nbytes // b.itemsize
        items.append((f"{isz}", elems * isz, isz, b.leaves))
    ops: list[Op] = []
    leaves = sum(b.leaves for b in buckets)
    if leaves:
        ops.append(Op("local", "leaf", "", 1, (leaves,)))
        ops.append(Op("local", "strategy", strategy, 1, (leaves, sum(b.nbytes for b in buckets))))
    group = NATIVE_SMALL_BYTES
    if strategy == "flat" and _alone(topo):
        group = bucket_bytes if bucket_bytes is not None else 1 << 62
    low16 = sum(n for _, n, isz, _ in items if isz == 2)
    wire16 = 2 * low16 > sum(n for _, n, _, _ in items)  # the host tier's "auto"
    if low16:  # 16-bit data: converted to float32 and back wherever it is summed
        ops.append(Op("local", "strategy16", strategy, 1, (low16,)))
    packed = sum(n for _, n, _, k in items if k > 1)
    if packed:
        ops.append(Op("local", "copy", "", 1, (2 * packed,)))  # pack + unpack

    def intra_bytes(n, isz):  # 16-bit is summed as float32 inside a process
        return n * 2 if isz == 2 else n

    def intra(kind, sizes, calls=1):
        if D > 1 and sizes:
            ops.append(Op("intra", kind, "device", D, tuple(sizes), 1, calls))

    def inter(items_, flows=1, chain=False, P=P, link=topo.link):
        # chain: one native call per buffer, in one ordered chain (naive): no
        # grouping across buffers, and the wait for the slowest process is paid
        # once per chain (calls=1), not per call; each message pays its alpha.
        if P <= 1 or not items_:
            return
        wide = [(d, n) for d, n, isz, _ in items_ if isz >= 4]
        low = [n for d, n, isz, _ in items_ if isz == 2]
        if low and topo.native and P == 2:
            # Two processes: the native target sums 16-bit buffers with the
            # others (a user-defined MPI operation, in place, same call).
            wide += [("2", n) for n in low]
            low = []
        if wide:
            msgs, copied = (
                _native_messages(wide, group)
                if topo.native and not chain
                else ([n for _, n in wide], 0)
            )
            calls = 1 if topo.native else len(wide)  # mpi4jax: one call per buffer
            piece = PIECE_BYTES if topo.native and link == "network" else 0
            ops.append(Op("inter", "allreduce", link, P, tuple(msgs), flows, calls, piece))
            if topo.staging == "host":
                ops.append(Op("local", "stage", "", 1, (2 * sum(n for _, n in wide),)))
            if copied:  # the target's memcpy into its scratch buffer and back
                ops.append(Op("local", "copy", "", 1, (2 * copied,)))
        if low:
            total = sum(low)
            if len(low) > 1:
                ops.append(Op("local", "copy", "", 1, (total,)))
            # alltoall of the padded buffer, each member sums 1/P, allgather back
            ops.append(Op("inter", "alltoall", link, P, (total,), flows))
            ops.append(Op("local", "copy", "", 1, (total,)))  # f32 sum of my slice
            ops.append(Op("inter", "allgather", link, P, (total,), flows))
            if topo.staging == "host":
                ops.append(Op("local", "stage", "", 1, (4 * total,)))

    bcast = D > 1 and P > 1 and topo.broadcast
    k = len(items)
    tier = topo.tiers(wire16) and strategy in ("flat", "hierarchical", "two_dimensional")
    L, H = topo.per_host, topo.hosts

    def host(kind, sizes, calls=1):  # the host tier's steps (16-bit summed as f32)
        # reduce and broadcast group small buffers as the allreduce does; a
        # reduce-scatter or an all-gather moves each buffer alone
        msgs, copied = list(sizes), 0
        if kind in ("reduce", "broadcast"):
            msgs, copied = _native_messages([("", n) for n in sizes], group)
        ops.append(Op("host", kind, "host", L, tuple(msgs), 1, calls))
        if copied:
            ops.append(Op("local", "copy", "", 1, (2 * copied,)))

    if tier and strategy != "two_dimensional":
        # processes of a host onto its leader, the leaders over the hosts, the
        # leader's result broadcast on the host
        intra("allreduce", [intra_bytes(n, isz) for _, n, isz, _ in items])  # one psum
        first = len(ops)
        host("reduce", [intra_bytes(n, isz) for _, n, isz, _ in items])
        inter(items, P=H)
        host("broadcast", [n for _, n, _, _ in items])
        total = sum(n for _, n, _, _ in items)
        if topo.native and total > TIER_CHUNK_BYTES:  # jaxsync_tier: stages pipelined
            m = -(-total // TIER_CHUNK_BYTES)
            ops[first:] = [
                dataclasses.replace(op, chunks=m) if op.kind != "copy" else op for op in ops[first:]
            ]
        if bcast:
            intra("allreduce", [n for _, n, _, _ in items], calls=k)
    elif tier:
        # a reduce-scatter over the devices, then over the host; each slice over
        # the hosts (D * L flows); all-gathers over the host, then the devices
        intra("reduce_scatter", [intra_bytes(n, isz) for _, n, isz, _ in items], calls=k)
        slices = [(d, -(-n // (D * isz)) * isz, isz, j) for d, n, isz, j in items]
        host("reduce_scatter", [intra_bytes(n, isz) for _, n, isz, _ in slices])
        if low16:  # widened into scratch and rounded back
            ops.append(Op("local", "copy", "", 1, (low16 // D,)))
        mine = [(d, -(-n // (L * isz)) * isz, isz, j) for d, n, isz, j in slices]
        inter(mine, flows=D * L, P=H)
        host("allgather", [n for _, n, _, _ in slices], calls=k)
        intra("allgather", [n for _, n, _, _ in items], calls=k)
    elif strategy == "naive":
        intra("allreduce", [intra_bytes(n, isz) for _, n, isz, _ in items], calls=k)
        if topo.native:  # one call per leaf, chained
            inter([it for it in items if it[2] >= 4 or P == 2], chain=True)
            for it in items:
                if it[2] == 2 and P > 2:
                    inter([it])
        else:
            for it in items:  # mpi4jax: one call per leaf
                inter([it])
        if bcast:  # one psum per buffer
            intra("allreduce", [n for _, n, _, _ in items], calls=k)
    elif strategy in ("flat", "hierarchical", "single_node"):
        intra("allreduce", [intra_bytes(n, isz) for _, n, isz, _ in items])  # one psum
        inter(items)
        if bcast:
            intra("allreduce", [n for _, n, _, _ in items], calls=k)
    else:  # two_dimensional: one reduce-scatter and one all-gather per buffer
        intra("reduce_scatter", [intra_bytes(n, isz) for _, n, isz, _ in items], calls=k)
        slices = [(d, -(-n // (D * isz)) * isz, isz, j) for d, n, isz, j in items]
        inter(slices, flows=D if P > 1 else 1)
        intra("allgather", [n for _, n, _, _ in items], calls=k)
    return ops


def predict(
    strategy: str,
    buckets: Sequence[BucketInfo],
    topo: ModelTopology,
    profile: Profile | None = None,
    comm_itemsize: int | None = None,
    bucket_bytes: int | None = FLAT_GROUP_BYTES,
) -> float:
    """Predicted seconds of one synchronisation with ``strategy``.

    The sum of :func:`strategy_ops` priced with ``profile`` (default
    :data:`jaxsync.auto._cost.DEFAULT_PROFILE`), never below :data:`MIN_SHARE` of
    its collectives and copies alone.

    Example:
      >>> b = [BucketInfo("float32", 4 * 2**20)]
      >>> topo = ModelTopology(processes=2, hosts=1, local_devices=1)
      >>> t = predict("hierarchical", b, topo)
      >>> t == Op("inter", "allreduce", "host", 2, (4 * 2**20,)).seconds(DEFAULT_PROFILE)
      True
    """
    profile = profile or DEFAULT_PROFILE
    ops = strategy_ops(strategy, buckets, topo, comm_itemsize, bucket_bytes)
    over = ("strategy", "strategy16")
    base = sum(op.seconds(profile) for op in ops if op.kind not in over and op.chunks <= 1)
    piped = [op.seconds(profile) for op in ops if op.chunks > 1]
    if piped:  # m chunks through the stages: one fill, then the slowest stage's pace
        m = max(op.chunks for op in ops)
        base += (sum(piped) + (m - 1) * max(piped)) / m
    total = base + sum(op.seconds(profile) for op in ops if op.kind in over)
    return max(total, MIN_SHARE * base)

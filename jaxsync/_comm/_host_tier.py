"""The host tier: the processes of one host reduced first, then the hosts.

When the processes span several hosts and a host holds more than one of them,
``flat``, ``hierarchical`` and ``two_dimensional`` send across hosts only what
ChainerMN's communicators send (:func:`program`): the host leader's buffer
(``hierarchical``), or each local rank's slice (``two_dimensional``). The
decision is collective, made once when a transform is made (:func:`decide`,
from ``_topology.Comms.prepare``), so every process takes the same path;
It is off unless ``JAXSYNC_HOST_TIER=1`` (see :func:`enabled`): in the
emulated cluster (2 cores, links shaped with tc tbf) its sequential host stages
and the leaders' single TCP flow cost more than MPI's own allreduce over every
process (docs/strategies.md).

Imports: the standard library (mpi4py inside the functions that need it).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

HOST_TIER_ENV = "JAXSYNC_HOST_TIER"
"""``1`` turns the host tier on (every process must see the same value)."""


def enabled() -> bool:
    """Whether ``$JAXSYNC_HOST_TIER`` asks for the host tier (``1``; default off)."""
    return os.environ.get(HOST_TIER_ENV, "0").strip() == "1"


@dataclasses.dataclass(frozen=True)
class HostTier:
    """The processes of this host and, on every other host, their peers.

    Per local device ``d``: ``host[d]``, this host's processes (ranked as in the
    world, so the lowest rank is local rank 0, the host's leader), and
    ``cross[d]``: the processes of this local rank on every host (for local
    rank 0: the hosts' leaders).

    Attributes:
      hosts: number of hosts.
      local_rank: this process's rank on its host.
      local_size: processes on this host.
      uniform: every host holds ``local_size`` processes (``two_dimensional``'s
        slices need it; ``hierarchical`` does not).
      host: per local device, a communicator of this host's processes.
      cross: per local device, a communicator of this local rank's processes.
    """

    hosts: int
    local_rank: int
    local_size: int
    uniform: bool
    host: tuple = ()
    cross: tuple = ()


def decide(control: Any, rank: int) -> tuple[HostTier | None, tuple, int]:
    """Whether this job has a host tier: ``(tier without device pairs, (host,
    cross) communicators, hosts)`` or ``(None, (), hosts)``. Collective over
    ``control``."""
    from mpi4py import MPI

    on = enabled()
    host = control.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = host.Get_rank(), host.Get_size()
    seen = control.allgather((local_rank == 0, local_size, on))
    hosts = sum(1 for first, _, _ in seen if first)
    if not all(o for _, _, o in seen) or hosts < 2 or max(k for _, k, _ in seen) < 2:
        host.Free()
        return None, (), hosts
    cross = control.Split(local_rank, key=rank)
    uniform = len({k for _, k, _ in seen}) == 1
    return HostTier(hosts, local_rank, local_size, uniform), (host, cross), hosts


def extend(tier: HostTier, base: tuple, n: int) -> HostTier:
    """``tier`` with (at least) ``n`` per-device pairs, duplicated from ``base``.
    Collective over the host and cross communicators."""
    host, cross = base
    pairs = [(host.Dup(), cross.Dup()) for _ in range(n - len(tier.host))]
    if not pairs:
        return tier
    return dataclasses.replace(
        tier,
        host=tier.host + tuple(h for h, _ in pairs),
        cross=tier.cross + tuple(c for _, c in pairs),
    )


def program(prog, host, cross, leader_only: bool):
    """``prog`` (a sum over ``ops``) run over the hosts, the host's processes first.

    ``host`` and ``cross`` are ops on this host's processes and on this local
    rank's process of every host. ``leader_only`` (ChainerMN's
    ``hierarchical``): the host's sum onto its leader (16-bit data summed in
    float32, rounded there), ``prog`` among the hosts' leaders (``cross`` is
    active on local rank 0 only), the leader's result broadcast on the host.
    Otherwise (``two_dimensional``): a reduce-scatter over the host, each local
    rank's slice through ``prog`` with the same local rank of the other hosts,
    an all-gather over the host.
    """

    def run(_, bufs):
        if leader_only:
            return host.bcast(prog(cross, host.reduce(bufs)))
        slices = prog(cross, host.reduce_scatter(bufs))
        return [host.allgather(s).reshape(-1)[: b.shape[0]] for s, b in zip(slices, bufs)]

    return run

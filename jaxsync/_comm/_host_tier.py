"""The host tier: the processes of one host reduced first, then the hosts.

When the processes span several hosts and a host holds more than one of them,
``flat``, ``hierarchical`` and ``two_dimensional`` send across hosts only what
ChainerMN's communicators send (:func:`program`): the host leader's buffer
(``hierarchical``), or each local rank's slice (``two_dimensional``). The
decision is collective, made once when a transform is made (:func:`decide`,
from ``_topology.Comms.prepare``), so every process takes the same path.
Whether a synchronisation takes it is the factories' ``host_tier`` option
(:func:`chosen`): ``"auto"`` (the default) when most of its bytes are 16-bit on
the wire, where the tier always sends fewer bytes across hosts than MPI's
all-to-all over every process; ``True`` whenever the topology has one;
``False`` never. ``JAXSYNC_HOST_TIER`` (``1``/``0``) overrides the option of
every transform (:func:`override`). See docs/strategies.md.

Imports: the standard library (mpi4py inside the functions that need it).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

HOST_TIER_ENV = "JAXSYNC_HOST_TIER"
"""``1`` forces the host tier on, ``0`` off, for every transform; unset: the
``host_tier`` option decides (the processes compare it before their first sum)."""

FAKE_HOSTS_ENV = "JAXSYNC_TESTING_HOSTS"
"""Private, for tests and measurements on one machine: ``k`` splits the processes
into ``k`` hosts of consecutive ranks instead of by shared memory."""

OPTIONS = (True, False, "auto")
"""The values of the factories' ``host_tier`` option."""


def override() -> bool | None:
    """``$JAXSYNC_HOST_TIER``: ``True`` (``1``), ``False`` (``0``) or ``None`` (unset).

    Raises:
      ValueError: any other value (naming the variable and the fix).
    """
    got = os.environ.get(HOST_TIER_ENV, "").strip()
    if got in ("", "0", "1"):
        return None if not got else got == "1"
    raise ValueError(
        f"{HOST_TIER_ENV} must be 1 (the host tier on), 0 (off) or unset (the "
        f"transforms' host_tier option decides), got {got!r}. Fix: "
        f"`export {HOST_TIER_ENV}=1`, `=0`, or `unset {HOST_TIER_ENV}`."
    )


def check(fn: str, option) -> None:
    """Validate ``fn``'s ``host_tier`` option and ``$JAXSYNC_HOST_TIER`` (1, 0 or unset).

    Raises:
      TypeError: ``option`` is not a bool or ``"auto"``.
      ValueError: another string, or the environment's value is not 1, 0 or unset.
    """
    fix = (
        "Fix: pass host_tier='auto' (default: the host tier for 16-bit wires), "
        "host_tier=True (whenever the topology has one) or host_tier=False (never)."
    )
    if isinstance(option, str) and option != "auto":
        raise ValueError(f"{fn}: host_tier must be one of {OPTIONS}, got {option!r}. {fix}")
    if not isinstance(option, (bool, str)):
        raise TypeError(
            f"{fn} got unexpected type for argument 'host_tier' (expected: one of "
            f"{OPTIONS}, got: {type(option).__name__} {option!r}). {fix}"
        )
    override()


def effective(option: bool | str) -> bool | str:
    """The ``host_tier`` option after the environment's override."""
    forced = override()
    return option if forced is None else forced


def sixteen(wire) -> bool:
    """Whether most of ``wire``'s bytes are 16-bit (``wire``: ``(itemsize,
    bytes)`` pairs, as they travel).

    Example:
      >>> sixteen([(2, 600), (4, 400)]), sixteen([(2, 400), (4, 400)])
      (True, False)
    """
    wire = list(wire)
    return 2 * sum(n for isz, n in wire if isz == 2) > sum(n for _, n in wire)


def chosen(option: bool | str, wire) -> bool:
    """Whether a synchronisation whose ``wire`` is as given takes the host tier
    (where the topology has one): ``option`` after the override; ``"auto"``:
    most of its bytes 16-bit (see :func:`sixteen`)."""
    option = effective(option)
    return sixteen(wire) if option == "auto" else bool(option)


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

    on = override() is not False  # made wherever it could be used, unless forced off
    fake = int(os.environ.get(FAKE_HOSTS_ENV, "0") or 0)
    if fake > 0:
        host = control.Split(rank * fake // control.Get_size(), key=rank)
    else:
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
    an all-gather over the host. Where ``host`` can (``pipelined``: jaxsync's
    native targets, more than one chunk's bytes), the three stages run in one call,
    at once over chunks.
    """

    # A quantized program (``_core._quantsum``) sums its first ``reduced``
    # buffers; the rest (its residuals) stay on each process: only the leader's
    # cross the hosts, and its new ones are broadcast with the sums.
    reduced = getattr(prog, "reduced", None)

    def run(_, bufs):
        if reduced is not None and leader_only:
            return host.bcast(prog(cross, host.reduce(bufs[:reduced]) + list(bufs[reduced:])))
        pipe = getattr(host, "pipelined", None)
        got = None if pipe is None else pipe(cross, bufs, leader_only)
        if got is not None:
            return got
        if leader_only:
            return host.bcast(prog(cross, host.reduce(bufs)))
        slices = prog(cross, host.reduce_scatter(bufs))
        return [host.allgather(s).reshape(-1)[: b.shape[0]] for s, b in zip(slices, bufs)]

    return run

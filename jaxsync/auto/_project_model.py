"""A user's cluster on paper: sync time per path, exposed time, step efficiency.

What it is for: ``python -m jaxsync tune --project`` with a :class:`Cluster`
(hosts, accelerators and processes a host, link rates and latencies per tier,
NIC rails) prices one synchronisation two ways:

* what jaxsync runs on GPUs today: the inter-process stage is mpi4jax (MPI,
  blocking, one call per buffer; through host memory unless MPI is CUDA-aware),
  each strategy priced by ``_cost_ops`` with the MPI algorithm a tuned MPI
  picks per message (ring, recursive doubling, Rabenseifner) - see
  :func:`mpi_profile`;
* beside it, what a NCCL-backed flat all-reduce over every accelerator would
  cost (:func:`nccl_allreduce`): NCCL's ring or tree, whichever is faster at
  that size and scale, with a per-collective latency that grows with the
  tree's depth (tree) or the number of hosts (ring).

and the time a step loses to it (:func:`exposed`): blocking, overlapped with
the backward pass (buckets summed as they are produced), or double-buffered
(the sum runs during the next step). The defaults of :class:`NcclLatency` and the
efficiencies are fitted to the published rows marked ``fit`` in
``published.json`` (``_published.fit_defaults`` recomputes them; a test checks).

May import: the standard library, ``_cost``, ``_cost_ops``, ``_choose``.

Example:
  >>> c = Cluster(hosts=2, devices=8, net_gbps=100, rails=4, net_eff=0.592)
  >>> t, algo = nccl_allreduce(2**30, c)
  >>> algo, round(t * 1e3)  # p4dn x 2 measured 35.2 ms (NVIDIA/nccl#527)
  ('tree', 36)
"""

from __future__ import annotations

import dataclasses
import math

from ._cost import Link, Profile


@dataclasses.dataclass(frozen=True)
class NcclLatency:
    """Latency of one NCCL all-reduce (seconds), before its bytes.

    Attributes:
      launch: the kernel launch and the protocol's fixed cost (stated: not fitted).
      intra: crossing the accelerators of a host (NVLink chain or ring).
      hop: one step across the network (tree: 2 per level; ring: 2 per host).
    """

    launch: float = 5e-6
    intra: float = 27.6e-6
    hop: float = 7.45e-6


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The question's cluster.

    Attributes:
      hosts: hosts.
      devices: accelerators per host.
      procs: processes per host (jaxsync's inter-process stage spans
        ``hosts * procs`` processes; each drives ``devices / procs``).
      intra_gbs: GB/s one way per accelerator inside a host (NVLink: 300 A100,
        450 H100/H200); the collectives reach ``intra_eff`` of it.
      intra_us: MPI latency per message between processes of a host.
      net_gbps: Gb/s of one NIC; ``rails`` NICs per host.
      net_us: MPI latency per message across hosts.
      net_eff: share of the NICs' line rate a collective reaches (0.96 on
        InfiniBand, fitted; EFA rows fit lower).
      intra_eff: share of ``intra_gbs`` NCCL's ring reaches (fitted: 0.82).
      pcie_gbs: GB/s of a copy between device and host (staging).
      cuda_aware: MPI reads device memory (no staging copies for mpi4jax).
    """

    hosts: int
    devices: int = 8
    procs: int = 1
    intra_gbs: float = 450.0
    intra_us: float = 5.0
    net_gbps: float = 100.0
    rails: int = 1
    net_us: float = 7.45
    net_eff: float = 0.96
    intra_eff: float = 0.822
    pcie_gbs: float = 25.0
    cuda_aware: bool = False

    def check(self) -> None:
        for f in ("hosts", "devices", "procs", "rails"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"--{f} must be an integer >= 1, got {v!r}")
        if self.devices % self.procs:
            raise ValueError(
                f"--devices ({self.devices}) must be a multiple of --procs ({self.procs})"
            )
        for f in ("intra_gbs", "net_gbps", "pcie_gbs", "net_eff", "intra_eff"):
            v = getattr(self, f)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"--{f.replace('_', '-')} must be > 0, got {v!r}")
        for f in ("intra_us", "net_us"):
            v = getattr(self, f)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"--{f.replace('_', '-')} must be >= 0, got {v!r}")

    @property
    def node_bw(self) -> float:
        """Bytes/s a host's NICs carry in a collective."""
        return self.rails * self.net_gbps / 8 * 1e9 * self.net_eff

    @property
    def intra_bw(self) -> float:
        return self.intra_gbs * 1e9 * self.intra_eff


def nccl_allreduce(
    nbytes: float, c: Cluster, lat: NcclLatency = NcclLatency()
) -> tuple[float, str]:
    """``(seconds, "ring"|"tree")``: a NCCL all-reduce of ``nbytes`` over all
    ``hosts * devices`` accelerators, the faster of NCCL's two algorithms.

    Ring: ``2 (N-1)/N`` of the bytes through the slowest link (a host's NICs, or
    NVLink), latency ``launch + intra + 2 (hosts-1) hop``. Tree (double binary
    tree across hosts, chains inside): a host sends and receives the whole
    buffer once (2 hosts) or twice (more), latency ``launch + intra + 2
    ceil(log2 hosts) hop``. One host: the ring over NVLink.

    Example:
      >>> one = Cluster(hosts=1, devices=8, intra_gbs=300)
      >>> t, algo = nccl_allreduce(2**30, one)  # p4dn: 8.14 ms (NVIDIA/nccl#527)
      >>> algo, round(t * 1e3, 1)
      ('ring', 7.7)
    """
    H, D = c.hosts, c.devices
    N = H * D
    if N <= 1 or nbytes <= 0:
        return 0.0, "none"
    base = lat.launch + (lat.intra if D > 1 else 0.0)
    if H == 1:
        return base + 2 * (N - 1) / N * nbytes / c.intra_bw, "ring"
    slow = min(c.node_bw, c.intra_bw)
    ring = base + 2 * (H - 1) * lat.hop + 2 * (N - 1) / N * nbytes / slow
    depth = math.ceil(math.log2(H))
    tree = base + 2 * depth * lat.hop + (1 if H == 2 else 2) * nbytes / slow
    return (ring, "ring") if ring <= tree else (tree, "tree")


def mpi_profile(c: Cluster) -> Profile:
    """The cost model's links for the mpi4jax path on ``c``: the device link
    (XLA collectives over NVLink), the host link (MPI between a host's
    processes over NVLink/shared memory) and the network (MPI across hosts,
    ``rails`` flows), each at its efficiency; device<->host staging at
    ``pcie_gbs`` (two copies, out and back)."""
    nv = Link(alpha=c.intra_us * 1e-6, beta=1 / c.intra_bw, gamma=1 / 1000e9)
    net = Link(
        alpha=c.net_us * 1e-6,
        beta=1 / (c.net_gbps / 8 * 1e9 * c.net_eff),
        gamma=1 / 1000e9,
        flows=c.rails,
    )
    return Profile(
        (("device", nv), ("host", nv), ("network", net)),
        copy=2 / 1000e9,  # HBM read + write
        topology=None,
        source="the question's links",
        stage=1 / (c.pcie_gbs * 1e9),
    )


def exposed(sync: float, compute: float, backward: float, buckets: int = 1) -> dict:
    """Seconds a step loses to a sync of ``sync`` seconds, and the step efficiency
    (``compute / (compute + lost)``), three ways:

    * ``blocking``: the whole sync after the backward pass;
    * ``overlap``: buckets summed as the backward produces them: the step ends
      at ``max(compute + sync / buckets, forward + sync)`` (the last bucket
      cannot start before the backward ends; the sums cannot start before it
      begins) - the form this repository's overlap suite measures within a few
      per cent (``docs/bench/overlap``; a test checks);
    * ``double``: double buffering, the sum of step t during step t+1: the step
      is ``max(compute, sync)`` (gradients one step stale).

    ``backward``: the share of ``compute`` that is the backward pass.

    Example:
      >>> e = exposed(sync=1.0, compute=1.0, backward=0.5, buckets=4)
      >>> e["blocking"]["lost_s"], e["overlap"]["lost_s"], e["double"]["lost_s"]
      (1.0, 0.5, 0.0)
    """
    if not (0.0 <= backward <= 1.0):
        raise ValueError(f"--backward-share must be in [0, 1], got {backward!r}")
    fwd = compute * (1 - backward)
    steps = {
        "blocking": compute + sync,
        "overlap": max(compute + sync / max(1, buckets), fwd + sync),
        "double": max(compute, sync),
    }
    return {
        k: {
            "lost_s": v - compute,
            "step_s": v,
            "efficiency": compute / v if v > 0 else 1.0,
        }
        for k, v in steps.items()
    }

"""A cost model of gradient synchronisation (numpy only, no JAX).

The alpha-beta-gamma model (Thakur, Rabenseifner and Gropp 2005; Patarasuk and
Yuan 2009 for rings): one collective over ``p`` members on a link costs
``a * alpha + b * beta + c * gamma`` seconds, where ``alpha`` is the latency of
one message, ``beta`` the seconds per byte on the link, ``gamma`` the seconds per
byte of local reduction, and ``a, b, c`` are the closed forms of the algorithm
(:func:`coefficients`). There is one :class:`Link` per kind of link:

* ``"device"`` - between the devices of one process (XLA collectives);
* ``"host"`` - between processes on one host (MPI over shared memory);
* ``"network"`` - between processes on different hosts.

:func:`strategy_ops` lists the collectives (and local copies) that each of
jaxsync's strategies issues for a packing plan (its buckets) and a topology,
following ``_strategies.run`` and the native MPI target (which sums buffers
under 64 KiB of one dtype together in one message); :func:`predict` prices
them with a :class:`Profile`. ``python -m jaxsync tune`` fits a profile on the
machine (``jaxsync._tune``); without one, :data:`DEFAULT_PROFILE` is used.

Example:
  >>> from jaxsync import _cost
  >>> link = _cost.Link(alpha=1e-5, beta=1e-9, gamma=0.0)
  >>> # ring allreduce of 1 MB over 4 members: 2*3 alpha + 2*3/4 * 1e6 beta
  >>> round(_cost.collective_seconds("allreduce", 10**6, 4, link, "ring") * 1e6, 3)
  1560.0
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Iterable, Sequence

import numpy as np

LINKS = ("device", "host", "network")
KINDS = ("allreduce", "reduce_scatter", "allgather", "alltoall", "broadcast")
ALGORITHMS = {
    "allreduce": ("ring", "recursive_doubling", "rabenseifner"),
    "reduce_scatter": ("ring",),
    "allgather": ("ring", "recursive_doubling"),
    "alltoall": ("pairwise",),
    "broadcast": ("binomial", "scatter_allgather"),
}
STRATEGY_NAMES = ("naive", "flat", "hierarchical", "two_dimensional", "single_node")

# The native MPI target sums buffers under this size of one dtype together, in
# groups of at most NATIVE_GROUP_BYTES (jaxsync/_native/mpi_ffi.cc).
NATIVE_SMALL_BYTES = 64 << 10
NATIVE_GROUP_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True)
class Link:
    """Parameters of one link.

    Attributes:
      alpha: seconds per message (latency).
      beta: seconds per byte sent by one member (inverse bandwidth of one flow).
      gamma: seconds per byte reduced locally.
      flows: concurrent flows the link carries at full bandwidth (e.g. NICs per
        host, "rails"); ``two_dimensional`` runs one flow per local device.
      algorithm: the algorithm assumed for every collective with such a name
        (``"ring"`` for a calibrated link, fitted with ring forms), else
        ``"auto"``: the fastest of :data:`ALGORITHMS` (what a tuned MPI picks).
      call: seconds per call (an XLA collective op, a native MPI call): its
        launch and the wait for the slowest member, paid once however many
        messages the call sends.
    """

    alpha: float
    beta: float
    gamma: float = 0.0
    flows: int = 1
    algorithm: str = "auto"
    call: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Profile:
    """Link parameters of a machine, as fitted by ``python -m jaxsync tune``.

    Attributes:
      links: ``{"device"|"host"|"network": Link}``; a link missing here is taken
        from :data:`DEFAULT_PROFILE` (``missing`` says which).
      copy: seconds per byte of a local copy (packing a bucket, unpacking it).
      leaf: seconds per reduced leaf per synchronisation, whatever the strategy
        (each leaf is an operand and a result of the step's sync: slicing,
        scaling, handing it to a call).
      topology: ``{"processes", "hosts", "local_devices"}`` it was measured on
        (``None`` for the built-in default).
      source: where it came from (a path, or ``"built-in default"``).
      fit: the calibration's report (relative errors per link), for display.
    """

    links: tuple
    copy: float
    topology: dict | None = None
    source: str = "built-in default"
    fit: dict | None = None
    leaf: float = 0.0

    def link(self, name: str) -> Link:
        for k, v in self.links:
            if k == name:
                return v
        if self is not DEFAULT_PROFILE:
            return DEFAULT_PROFILE.link(name)
        raise KeyError(name)

    def has(self, name: str) -> bool:
        return any(k == name for k, _ in self.links)

    def missing(self) -> list[str]:
        return [n for n in LINKS if not self.has(n)]

    def to_json(self) -> dict:
        return {"format": "jaxsync-profile-1",
                "links": {k: v.as_dict() for k, v in self.links},
                "copy": self.copy, "leaf": self.leaf, "topology": self.topology,
                "fit": self.fit}

    @classmethod
    def from_json(cls, data: dict, source: str = "<dict>") -> "Profile":
        if not isinstance(data, dict) or data.get("format") != "jaxsync-profile-1":
            raise ValueError(f"{source}: not a jaxsync profile (expected a JSON object "
                             "with format 'jaxsync-profile-1'); write one with "
                             "`python -m jaxsync tune --out FILE`.")
        links = []
        for name in LINKS:
            if name in data.get("links", {}):
                d = data["links"][name]
                links.append((name, Link(float(d["alpha"]), float(d["beta"]),
                                         float(d.get("gamma", 0.0)),
                                         int(d.get("flows", 1)),
                                         str(d.get("algorithm", "auto")),
                                         float(d.get("call", 0.0)))))
        return cls(tuple(links), float(data.get("copy", DEFAULT_PROFILE.copy)),
                   data.get("topology"), source, data.get("fit"),
                   float(data.get("leaf", 0.0)))

    def digest(self) -> str:
        """Short hash of the parameters (not the source): equal profiles, equal digest."""
        body = json.dumps({"links": {k: v.as_dict() for k, v in self.links},
                           "copy": self.copy, "leaf": self.leaf}, sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()[:12]

    def replace_link(self, name: str, link: Link) -> "Profile":
        links = tuple((k, v) for k, v in self.links if k != name) + ((name, link),)
        return dataclasses.replace(self, links=tuple(sorted(links, key=lambda kv: LINKS.index(kv[0]))))


DEFAULT_PROFILE = Profile(
    links=(
        # XLA collectives between fake CPU devices of one process (a rendezvous of
        # threads per collective) - the figures of this project's 2-core machine.
        ("device", Link(alpha=60e-6, beta=0.8e-9, gamma=0.4e-9)),
        # MPI between processes of one host through shared memory (one native call).
        ("host", Link(alpha=40e-6, beta=0.5e-9, gamma=0.3e-9)),
        # 100 Gb/s Ethernet/InfiniBand class network, one NIC per host.
        ("network", Link(alpha=15e-6, beta=8e-11, gamma=0.3e-9)),
    ),
    copy=0.3e-9,
)
"""Used when no profile is given or found; documented in the README."""


# --------------------------------------------------------------------------
# Closed forms
# --------------------------------------------------------------------------

def _pow2_floor(p: int) -> int:
    return 1 << (int(p).bit_length() - 1)


def coefficients(kind: str, nbytes: float, p: int, algorithm: str) -> tuple[float, float, float]:
    """``(a, b, c)``: the collective costs ``a*alpha + b*beta + c*gamma`` seconds.

    ``nbytes`` is the size of the whole buffer of one member: the input of an
    allreduce, reduce-scatter, all-to-all or broadcast, the output of an
    all-gather. ``p`` members. Non-powers of two in the recursive algorithms pay
    MPICH's extra step (the surplus members hand their data to a partner first
    and get the result back).

    Example:
      >>> coefficients("allreduce", 800.0, 4, "ring")
      (6, 1200.0, 600.0)
      >>> coefficients("allreduce", 800.0, 4, "recursive_doubling")
      (2, 1600.0, 1600.0)
      >>> coefficients("allreduce", 800.0, 3, "recursive_doubling")  # 2 + extra step
      (3, 2400.0, 1600.0)
    """
    if p <= 1 or nbytes <= 0:
        return (0, 0.0, 0.0)
    n = float(nbytes)
    frac = (p - 1) / p
    q = _pow2_floor(p)
    lg = int(math.log2(q))
    extra = q != p
    if kind == "allreduce":
        if algorithm == "ring":
            return (2 * (p - 1), 2 * frac * n, frac * n)
        if algorithm == "recursive_doubling":
            a, b, c = lg, lg * n, lg * n
        elif algorithm == "rabenseifner":
            fq = (q - 1) / q
            a, b, c = 2 * lg, 2 * fq * n, fq * n
        else:
            raise ValueError(f"unknown allreduce algorithm {algorithm!r}")
        if extra:
            a, b, c = a + 2, b + 2 * n, c + n
        return (a, b, c)
    if kind == "reduce_scatter":
        return (p - 1, frac * n, frac * n)
    if kind == "allgather":
        if algorithm == "ring" or extra:
            return (p - 1, frac * n, 0.0)
        return (lg, frac * n, 0.0)  # recursive doubling, power of two
    if kind == "alltoall":
        return (p - 1, frac * n, 0.0)
    if kind == "broadcast":
        lgc = math.ceil(math.log2(p))
        if algorithm == "binomial":
            return (lgc, lgc * n, 0.0)
        return (lgc + p - 1, 2 * frac * n, 0.0)  # scatter + ring allgather
    raise ValueError(f"unknown collective {kind!r}; expected one of {KINDS}")


def collective_seconds(kind: str, nbytes: float, members: int, link: Link,
                       algorithm: str = "auto", flows: int = 1) -> float:
    """Predicted seconds of one collective.

    Args:
      kind: one of :data:`KINDS`.
      nbytes: bytes of one member's whole buffer (see :func:`coefficients`).
      members: processes (or devices) taking part.
      link: the link's parameters.
      algorithm: one of :data:`ALGORITHMS` ``[kind]``, or ``"auto"``: the
        fastest of them (what a tuned MPI picks), or ``"link"``:
        ``link.algorithm``.
      flows: how many such collectives run at the same time over the link;
        beyond ``link.flows`` they share its bandwidth.

    Example:
      >>> link = Link(alpha=1e-6, beta=1e-9, gamma=1e-10)
      >>> round(collective_seconds("allgather", 4000, 4, link, "ring") * 1e6, 9)  # 3 + 3
      6.0
      >>> collective_seconds("allreduce", 1000, 1, link)  # one member: nothing to do
      0.0
    """
    if kind not in ALGORITHMS:
        raise ValueError(f"unknown collective {kind!r}; expected one of {KINDS}")
    share = max(1.0, flows / max(1, link.flows))
    if algorithm == "link":  # the link's own choice, where it names one of kind's
        algorithm = link.algorithm if link.algorithm in ALGORITHMS[kind] else "auto"
    algos = ALGORITHMS[kind] if algorithm == "auto" else (algorithm,)
    best = math.inf
    for algo in algos:
        a, b, c = coefficients(kind, nbytes, members, algo)
        best = min(best, a * link.alpha + b * link.beta * share + c * link.gamma)
    return best


# --------------------------------------------------------------------------
# What each strategy issues
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BucketInfo:
    """One buffer of a plan: its dtype, bytes and how many leaves it packs."""

    dtype: str
    nbytes: int
    leaves: int = 1

    @property
    def itemsize(self) -> int:
        return 2 if self.dtype in ("float16", "bfloat16") else (
            8 if self.dtype == "float64" else 4)


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
    """

    processes: int = 1
    hosts: int = 1
    local_devices: int = 1
    native: bool = True
    broadcast: bool = True
    inter_link: str | None = None

    @property
    def link(self) -> str:
        if self.inter_link:
            return self.inter_link
        return "host" if self.hosts <= 1 else "network"


@dataclasses.dataclass(frozen=True)
class Op:
    """Collectives of one kind issued at one stage (one message per size)."""

    stage: str       # "intra", "inter", "local"
    kind: str        # a collective, or "copy"
    link: str
    members: int
    sizes: tuple     # bytes of each message (whole buffer per member)
    flows: int = 1
    calls: int = 1   # separate calls (ops) that send these messages

    def seconds(self, profile: Profile) -> float:
        if self.kind == "copy":
            return profile.copy * float(sum(self.sizes))
        if self.kind == "leaf":
            return profile.leaf * float(sum(self.sizes))
        link = profile.link(self.link)
        return self.calls * link.call + float(sum(collective_seconds(self.kind, s, self.members, link, "link",
                                            flows=self.flows) for s in self.sizes))


def _native_messages(sizes: Iterable[tuple[str, int]]) -> list[int]:
    """Messages of one native allreduce call: big buffers alone, small ones of a
    dtype grouped (mpi_ffi.cc's Group)."""
    out, groups = [], {}
    for dtype, n in sizes:
        if n >= NATIVE_SMALL_BYTES:
            out.append(n)
            continue
        g = groups.setdefault(dtype, [])
        if g and g[-1] + n <= NATIVE_GROUP_BYTES:
            g[-1] += n
        else:
            g.append(n)
    for g in groups.values():
        out += g
    return out


def per_leaf_plan(strategy: str, topo: ModelTopology) -> bool:
    """Whether ``_sync`` plans this strategy one buffer per leaf."""
    alone = topo.local_devices == 1 and topo.native and topo.processes > 1
    return strategy == "naive" or (alone and strategy in ("hierarchical", "two_dimensional"))


def strategy_ops(strategy: str, buckets: Sequence[BucketInfo], topo: ModelTopology,
                 comm_itemsize: int | None = None) -> list[Op]:
    """The collectives and copies ``strategy`` issues for ``buckets``.

    ``buckets`` is the plan ``_sync`` makes for this strategy (see
    :func:`per_leaf_plan`); ``comm_itemsize`` the bytes per element on the wire
    when ``comm_dtype`` is set. Mirrors ``_strategies.run``: 16-bit buffers are
    summed as float32 inside a process and travel as 16 bits through an
    all-to-all and an all-gather across processes (with the native target
    between two processes: in its allreduce, like the others).
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
    packed = sum(n for _, n, _, k in items if k > 1)
    if packed:
        ops.append(Op("local", "copy", "", 1, (2 * packed,)))  # pack + unpack

    def intra_bytes(n, isz):  # 16-bit is summed as float32 inside a process
        return n * 2 if isz == 2 else n

    def intra(kind, sizes, calls=1):
        if D > 1 and sizes:
            ops.append(Op("intra", kind, "device", D, tuple(sizes), 1, calls))

    def inter(items_, flows=1):
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
            msgs = _native_messages(wide) if topo.native else [n for _, n in wide]
            calls = 1 if topo.native else len(wide)  # mpi4jax: one call per buffer
            ops.append(Op("inter", "allreduce", topo.link, P, tuple(msgs), flows, calls))
        if low:
            total = sum(low)
            if len(low) > 1:
                ops.append(Op("local", "copy", "", 1, (total,)))
            # alltoall of the padded buffer, each member sums 1/P, allgather back
            ops.append(Op("inter", "alltoall", topo.link, P, (total,), flows))
            ops.append(Op("local", "copy", "", 1, (total,)))  # f32 sum of my slice
            ops.append(Op("inter", "allgather", topo.link, P, (total,), flows))

    bcast = D > 1 and P > 1 and topo.broadcast
    k = len(items)
    if strategy == "naive":
        intra("allreduce", [intra_bytes(n, isz) for _, n, isz, _ in items], calls=k)
        for it in items:  # one call per leaf
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


def predict(strategy: str, buckets: Sequence[BucketInfo], topo: ModelTopology,
            profile: Profile | None = None, comm_itemsize: int | None = None) -> float:
    """Predicted seconds of one synchronisation with ``strategy``.

    Example:
      >>> b = [BucketInfo("float32", 4 * 2**20)]
      >>> topo = ModelTopology(processes=2, hosts=1, local_devices=1)
      >>> t = predict("hierarchical", b, topo)
      >>> t == Op("inter", "allreduce", "host", 2, (4 * 2**20,)).seconds(DEFAULT_PROFILE)
      True
    """
    profile = profile or DEFAULT_PROFILE
    return sum(op.seconds(profile) for op in strategy_ops(strategy, buckets, topo, comm_itemsize))


# --------------------------------------------------------------------------
# Calibration: a linear least-squares fit of alpha, beta, gamma per link
# --------------------------------------------------------------------------

def fit_link(samples: Sequence[tuple], algorithm: dict | None = None) -> tuple[Link, dict]:
    """Fit ``alpha, beta, gamma`` (and ``call``) of one link from timed collectives.

    Args:
      samples: ``(kind, nbytes, members, seconds)`` measurements of one call
        sending one message of ``nbytes``, or ``(kind, nbytes, members, seconds,
        messages)``: one call sending ``messages`` messages of ``nbytes`` each.
        ``call`` (per call) is fitted only when some sample sends several
        messages in one call (otherwise it cannot be told from ``alpha``: 0).
      algorithm: the algorithm per kind the measurements used (default: ring
        allreduce, ring reduce-scatter/all-gather, pairwise all-to-all).

    Returns:
      ``(link, report)``: non-negative parameters minimising the squared
      *relative* error, and ``{"median_rel_error", "max_rel_error", "samples",
      "dropped"}`` (non-positive marginal times, i.e. noise, are dropped).

    Example:
      >>> true = Link(alpha=2e-5, beta=1e-9, gamma=5e-10)
      >>> s = [(k, n, 2, collective_seconds(k, n, 2, true, "ring"))
      ...      for k in ("allreduce", "allgather") for n in (1e3, 1e5, 1e7)]
      >>> got, rep = fit_link(s)
      >>> [round(x / y, 6) for x, y in zip((got.alpha, got.beta, got.gamma),
      ...                                  (true.alpha, true.beta, true.gamma))]
      [1.0, 1.0, 1.0]
    """
    algorithm = {"allreduce": "ring", "allgather": "ring", "reduce_scatter": "ring",
                 "alltoall": "pairwise", "broadcast": "binomial", **(algorithm or {})}
    used = [tuple(s) + (1,) * (5 - len(s)) for s in samples if s[3] > 0]  # noise: <= 0
    if not used:
        raise ValueError("fit_link: no positive timing to fit")
    with_call = any(m > 1 for *_, m in used)
    rows, y = [], []
    for kind, n, p, t, m in used:
        a, b, c = coefficients(kind, n, p, algorithm[kind])
        w = 1.0 / max(float(t), 1e-9)
        rows.append([m * a * w, m * b * w, m * c * w] + ([w] if with_call else []))
        y.append(float(t) * w)
    A = np.asarray(rows, np.float64)
    # Scale the columns to unit norm so that alpha (1e-5) and beta (1e-10) are
    # solved with the same conditioning.
    scale = np.linalg.norm(A, axis=0)
    scale[scale == 0] = 1.0
    x = _nnls3(A / scale, np.asarray(y))
    alpha, beta, gamma, *call = (x / scale).tolist()
    link = Link(alpha, beta, gamma, algorithm="ring", call=call[0] if call else 0.0)
    errs = [abs(link.call + m * collective_seconds(k, n, p, link, algorithm[k]) - t) / t
            for k, n, p, t, m in used]
    return link, {"median_rel_error": float(np.median(errs)),
                  "max_rel_error": float(np.max(errs)), "samples": len(used),
                  "dropped": len(samples) - len(used)}


def _nnls3(A, y):
    """Non-negative least squares for a few columns: the best of the
    unconstrained fits on every subset of columns whose solution is >= 0."""
    import itertools
    k = A.shape[1]
    best, best_res = np.zeros(k), float(np.sum(y * y))
    for r in range(1, k + 1):
        for cols in itertools.combinations(range(k), r):
            sub = A[:, cols]
            if np.linalg.matrix_rank(sub) < r:
                continue
            sol, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(sol < 0):
                continue
            res = float(np.sum((sub @ sol - y) ** 2))
            if res < best_res:
                best = np.zeros(k)
                best[list(cols)] = sol
                best_res = res
    return best


def fit_copy(samples: Sequence[tuple[float, float]]) -> float:
    """Seconds per byte of a local copy from ``(bytes, seconds)``, through the origin.

    Example:
      >>> fit_copy([(1e6, 1e-3), (2e6, 2e-3)])
      1e-09
    """
    used = [s for s in samples if s[1] > 0] or [(1.0, 0.0)]
    n = np.asarray([s[0] for s in used], np.float64)
    t = np.asarray([s[1] for s in used], np.float64)
    w = 1.0 / np.maximum(t, 1e-9)
    return float(max(0.0, np.sum(n * t * w * w) / max(np.sum(n * n * w * w), 1e-300)))

"""The cost model's parameters and closed forms (numpy only, no JAX).

What it is for: the alpha-beta-gamma model (Thakur, Rabenseifner and Gropp 2005;
Patarasuk and Yuan 2009 for rings): one collective over ``p`` members on a link
costs ``a * alpha + b * beta + c * gamma`` seconds, where ``alpha`` is the
latency of one message, ``beta`` the seconds per byte on the link, ``gamma`` the
seconds per byte of local reduction, and ``a, b, c`` are the closed forms of the
algorithm (:func:`coefficients`). There is one :class:`Link` per kind of link:

* ``"device"`` - between the devices of one process (XLA collectives);
* ``"host"`` - between processes on one host (MPI over shared memory);
* ``"network"`` - between processes on different hosts.

A :class:`Profile` holds the links of a machine, the cost of local copies and
the calibrated per-strategy overheads. What each strategy issues and the
prediction of a whole synchronisation are in ``jaxsync.auto._cost_ops``; the fits in
``jaxsync.auto._cost_fit``; ``python -m jaxsync tune`` (``jaxsync.auto._tune``) measures.
Without a profile, :data:`DEFAULT_PROFILE` is used.

May import: the standard library and numpy only (no JAX, nothing of jaxsync).

Example:
  >>> from jaxsync.auto import _cost
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

LINKS = ("device", "host", "network")
KINDS = ("allreduce", "reduce_scatter", "allgather", "alltoall", "broadcast", "reduce")
ALGORITHMS = {
    "allreduce": ("ring", "recursive_doubling", "rabenseifner"),
    "reduce_scatter": ("ring",),
    "allgather": ("ring", "recursive_doubling"),
    "alltoall": ("pairwise",),
    "broadcast": ("binomial", "scatter_allgather"),
    "reduce": ("binomial", "reduce_scatter_gather"),
}
STRATEGY_NAMES = ("naive", "flat", "hierarchical", "two_dimensional", "single_node")

# The native MPI target sums buffers under this size of one dtype together, in
# groups of at most NATIVE_GROUP_BYTES (jaxsync/_comm/_native/mpi_ffi.cc).
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
      overheads: ``((strategy, (per_leaf, per_byte)), ...)``: what a whole
        synchronisation with ``strategy`` costs beyond its collectives and
        copies, per reduced leaf and per byte of the tree (seconds, either may
        be negative: see ``jaxsync.auto._cost_fit.fit_overhead``), fitted by
        ``tune`` on whole syncs of synthetic trees.
      overheads16: ``((strategy, per_byte), ...)``: what a whole
        synchronisation with ``strategy`` costs per byte of 16-bit (float16,
        bfloat16) data beyond the above (seconds, >= 0: conversions to float32
        and back, the user-defined MPI sum), fitted by ``tune`` on a whole sync
        of a synthetic bfloat16 tree.
      topology: ``{"processes", "hosts", "local_devices"}`` it was measured on
        (``None`` for the built-in default); ``tune`` adds ``"per_host"``
        (processes per host), ``"host_tier"`` (its rule: ``"auto"``,
        16-bit syncs only; ``True``/``False``),
        ``"measured"`` (per link: the processes or devices it was measured
        among) and, inside ``python -m jaxsync cluster``, ``"cluster"`` (the
        shaped link: ``{"link", "rate_bps", "hosts", "procs_per_host"}``).
      source: where it came from (a path, or ``"built-in default"``).
      fit: the calibration's report (relative errors per link), for display.
      stage: seconds per byte of a copy between device and host memory and back
        (host staging; mpi4jax without CUDA-aware MPI); 0: ``copy``'s.
    """

    links: tuple
    copy: float
    topology: dict | None = None
    source: str = "built-in default"
    fit: dict | None = None
    leaf: float = 0.0
    overheads: tuple = ()
    overheads16: tuple = ()
    stage: float = 0.0

    def link(self, name: str) -> Link:
        for k, v in self.links:
            if k == name:
                return v
        if self is not DEFAULT_PROFILE:
            return DEFAULT_PROFILE.link(name)
        raise KeyError(name)

    def has(self, name: str) -> bool:
        return any(k == name for k, _ in self.links)

    def overhead(self, strategy: str) -> tuple[float, float]:
        """``(seconds per leaf, seconds per byte)`` of ``strategy`` (0, 0 if not fitted)."""
        for k, v in self.overheads:
            if k == strategy:
                return (float(v[0]), float(v[1]))
        return (0.0, 0.0)

    def overhead16(self, strategy: str) -> float:
        """Seconds per byte of 16-bit data of ``strategy`` (0 if not fitted)."""
        return next((float(v) for k, v in self.overheads16 if k == strategy), 0.0)

    def missing(self) -> list[str]:
        return [n for n in LINKS if not self.has(n)]

    def to_json(self) -> dict:
        return {
            "format": "jaxsync-profile-1",
            "links": {k: v.as_dict() for k, v in self.links},
            "copy": self.copy,
            "leaf": self.leaf,
            "topology": self.topology,
            "overheads": {k: list(v) for k, v in self.overheads},
            "overheads16": dict(self.overheads16),
            "fit": self.fit,
            **({"stage": self.stage} if self.stage else {}),
        }

    @classmethod
    def from_json(cls, data: dict, source: str = "<dict>") -> Profile:
        if not isinstance(data, dict) or data.get("format") != "jaxsync-profile-1":
            raise ValueError(
                f"{source}: not a jaxsync profile (expected a JSON object "
                "with format 'jaxsync-profile-1'); write one with "
                "`python -m jaxsync tune --out FILE`."
            )
        links = []
        for name in LINKS:
            if name in data.get("links", {}):
                d = data["links"][name]
                links.append(
                    (
                        name,
                        Link(
                            float(d["alpha"]),
                            float(d["beta"]),
                            float(d.get("gamma", 0.0)),
                            int(d.get("flows", 1)),
                            str(d.get("algorithm", "auto")),
                            float(d.get("call", 0.0)),
                        ),
                    )
                )
        got = (data.get("overheads") or {}).items()
        for k, v in got:
            if not isinstance(v, (list, tuple)) or len(v) != 2:
                raise ValueError(
                    f"{source}: overheads[{k!r}] must be [seconds per leaf, seconds per "
                    f"byte], got {v!r}; write the profile again with `python -m jaxsync "
                    "tune --out FILE`."
                )
        over = tuple(sorted((str(k), (float(v[0]), float(v[1]))) for k, v in got))
        got16 = (data.get("overheads16") or {}).items()
        over16 = tuple(sorted((str(k), float(v)) for k, v in got16))
        prof = cls(
            tuple(links),
            float(data.get("copy", DEFAULT_PROFILE.copy)),
            data.get("topology"),
            source,
            data.get("fit"),
            float(data.get("leaf", 0.0)),
            over,
            over16,
            float(data.get("stage", 0.0)),
        )
        bad = prof.problems()
        if bad:
            raise ValueError(
                f"{source}: {'; '.join(bad)}; write the profile again with `python -m "
                "jaxsync tune --out FILE`."
            )
        return prof

    def problems(self) -> list[str]:
        """What makes the parameters unusable (empty when none): a negative or
        non-finite time, a flow count below 1."""

        def bad(x, low: float | None = 0.0) -> bool:
            return not math.isfinite(x) or (low is not None and x < low)

        out = []
        for name, link in self.links:
            for field in ("alpha", "beta", "gamma", "call"):
                value = getattr(link, field)
                if bad(value):
                    out.append(f"links.{name}.{field} must be a finite number >= 0, got {value}")
            if link.flows < 1:
                out.append(f"links.{name}.flows must be >= 1, got {link.flows}")
        for field in ("copy", "leaf", "stage"):
            if bad(getattr(self, field)):
                out.append(f"{field} must be a finite number >= 0, got {getattr(self, field)}")
        for k, (per_leaf, per_byte) in self.overheads:  # either may be negative
            if bad(per_leaf, None) or bad(per_byte, None):
                out.append(f"overheads[{k!r}] must be finite, got {[per_leaf, per_byte]}")
        for k, v in self.overheads16:
            if bad(v):
                out.append(f"overheads16[{k!r}] must be a finite number >= 0, got {v}")
        return out

    def digest(self) -> str:
        """Short hash of the parameters (not the source): equal profiles, equal digest."""
        body: dict = {
            "links": {k: v.as_dict() for k, v in self.links},
            "copy": self.copy,
            "leaf": self.leaf,
        }
        if self.overheads:  # (profiles without them keep their digest)
            body["overheads"] = {k: list(v) for k, v in self.overheads}
        if self.overheads16:
            body["overheads16"] = dict(self.overheads16)
        if self.stage:
            body["stage"] = self.stage
        text = json.dumps(body, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def replace_link(self, name: str, link: Link) -> Profile:
        links = tuple((k, v) for k, v in self.links if k != name) + ((name, link),)
        return dataclasses.replace(
            self, links=tuple(sorted(links, key=lambda kv: LINKS.index(kv[0])))
        )


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
"""Used when no profile is given or found; documented in docs/choosing.md."""


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
    if kind == "reduce":  # onto one member
        lgc = math.ceil(math.log2(p))
        if algorithm == "binomial":
            return (lgc, lgc * n, lgc * n)
        return (lgc + p - 1, 2 * frac * n, frac * n)  # ring reduce-scatter + gather
    raise ValueError(f"unknown collective {kind!r}; expected one of {KINDS}")


def collective_seconds(
    kind: str, nbytes: float, members: int, link: Link, algorithm: str = "auto", flows: int = 1
) -> float:
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

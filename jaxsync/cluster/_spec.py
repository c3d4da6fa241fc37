"""What an emulated cluster is: hosts, processes per host, links, faults.

Plain data, validated when it is made (the factory's rule): a bad rate or a fault
on a host that does not exist fails before anything is built.
"""

from __future__ import annotations

import dataclasses
import json
import re

_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?bit)\s*$", re.IGNORECASE)


def parse_rate(rate: str, *, argument: str = "link") -> float:
    """A link rate in tc's words (``"1gbit"``, ``"100mbit"``, ``"2.5gbit"``) in bits/s.

    Args:
      rate: a number and one of ``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit``.
      argument: the argument's name, for the error message.

    Returns:
      The rate in bits per second.

    Raises:
      ValueError: not a rate, or not positive.

    Example:
      >>> from jaxsync.cluster import parse_rate
      >>> parse_rate("1gbit"), parse_rate("100mbit")
      (1000000000.0, 100000000.0)
    """
    m = _RATE.match(str(rate))
    value = float(m.group(1)) * _UNITS[m.group(2).lower()] if m else 0.0
    if value <= 0:
        raise ValueError(
            f"jaxsync.cluster: {argument} must be a positive rate in tc's words "
            f"(e.g. '1gbit', '10gbit', '100mbit'), got {rate!r}."
        )
    return value


@dataclasses.dataclass(frozen=True)
class LinkDown:
    """A fault: one host's link goes down ``at`` seconds after the program starts.

    Attributes:
      host: the host's index (0 .. hosts-1).
      at: seconds after the launch (the clock in ``$JAXSYNC_CLUSTER_T0``).
      duration: seconds until the link comes back; ``None``: down for good.

    Example:
      >>> from jaxsync.cluster import LinkDown
      >>> LinkDown(host=1, at=5.0, duration=2.0)
      LinkDown(host=1, at=5.0, duration=2.0)
    """

    host: int
    at: float
    duration: float | None = None

    def __post_init__(self):
        if not isinstance(self.host, int) or self.host < 0:
            raise ValueError(
                f"jaxsync.cluster: LinkDown.host must be a host index >= 0, got {self.host!r}."
            )
        if not self.at >= 0:
            raise ValueError(f"jaxsync.cluster: LinkDown.at must be seconds >= 0, got {self.at!r}.")
        if self.duration is not None and not self.duration > 0:
            raise ValueError(
                "jaxsync.cluster: LinkDown.duration must be seconds > 0, or None for a link "
                f"down for good, got {self.duration!r}."
            )

    @classmethod
    def parse(cls, text: str) -> LinkDown:
        """``"H@T"`` (down for good) or ``"H@T+D"`` (down for D seconds), as the CLI takes it.

        Example:
          >>> from jaxsync.cluster import LinkDown
          >>> LinkDown.parse("1@5+2"), LinkDown.parse("0@3")
          (LinkDown(host=1, at=5.0, duration=2.0), LinkDown(host=0, at=3.0, duration=None))
        """
        m = re.match(r"^\s*(\d+)\s*@\s*(\d+(?:\.\d+)?)\s*(?:\+\s*(\d+(?:\.\d+)?))?\s*$", text)
        if not m:
            raise ValueError(
                f"jaxsync.cluster: --link-down must be HOST@SECONDS (down for good) or "
                f"HOST@SECONDS+DURATION, e.g. '1@5+2', got {text!r}."
            )
        d = m.group(3)
        return cls(int(m.group(1)), float(m.group(2)), None if d is None else float(d))


@dataclasses.dataclass(frozen=True)
class Spec:
    """The whole emulated cluster (made by :func:`jaxsync.cluster.run`)."""

    hosts: int
    procs_per_host: int
    link: str
    devices: int | None = None
    slow: tuple[tuple[int, str], ...] = ()
    faults: tuple[LinkDown, ...] = ()

    def __post_init__(self):
        for name in ("hosts", "procs_per_host"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"jaxsync.cluster: {name} must be an int >= 1, got {v!r}.")
        if self.hosts > 64:
            raise ValueError(f"jaxsync.cluster: hosts must be at most 64, got {self.hosts}.")
        if self.devices is not None and (not isinstance(self.devices, int) or self.devices < 1):
            raise ValueError(
                f"jaxsync.cluster: devices (fake CPU devices per process) must be an int >= 1 "
                f"or None, got {self.devices!r}."
            )
        parse_rate(self.link)
        for host, rate in self.slow:
            self._check_host(host, "slow")
            parse_rate(rate, argument=f"slow[{host}]")
        for f in self.faults:
            self._check_host(f.host, "link_down")

    def _check_host(self, host, what):
        if not isinstance(host, int) or not 0 <= host < self.hosts:
            raise ValueError(
                f"jaxsync.cluster: {what} names host {host!r}, but the cluster has hosts "
                f"0..{self.hosts - 1}."
            )

    @property
    def size(self) -> int:
        return self.hosts * self.procs_per_host

    def rate(self, host: int) -> str:
        """The tc rate of ``host``'s link."""
        return dict(self.slow).get(host, self.link)

    def address(self, host: int) -> str:
        """``host``'s address on the cluster's bridge (inside its own namespaces only)."""
        return f"{SUBNET}.{10 + host}"

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> Spec:
        d = json.loads(text)
        d["slow"] = tuple((int(h), str(r)) for h, r in d["slow"])
        d["faults"] = tuple(LinkDown(**f) for f in d["faults"])
        return cls(**d)


SUBNET = "10.233.0"
"""The cluster's /24 (the bridge is ``.1``, host h is ``.10+h``). It exists only in
the network namespaces the cluster creates: nothing is sent outside them."""

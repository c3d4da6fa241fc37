"""What an emulated cluster is: hosts, processes per host, links, faults.

Plain data, validated when it is made (the factory's rule): a bad rate or a fault
on a host that does not exist fails before anything is built. Also the markers a
program sets (:func:`mark`) for faults that follow its progress.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
import re
import threading
import time
from pathlib import Path

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


MARKS_ENV = "JAXSYNC_CLUSTER_MARKS"
"""The environment variable that gives the ranks the folder :func:`mark` writes to."""

_MARKER = re.compile(r"^[A-Za-z][A-Za-z0-9._-]{0,63}$")
_MARKER_RULE = "a letter, then up to 63 letters, digits, '.', '_' or '-'"


def _check_marker(name: object, argument: str) -> str:
    if not isinstance(name, str) or not _MARKER.match(name):
        raise ValueError(
            f"jaxsync.{argument} must be a marker name ({_MARKER_RULE}), got {name!r}. "
            "Fix: a name such as 'step-3' (f'step-{i}'), the same in the program's "
            "jaxsync.cluster.mark(...) and in LinkDown(after=...)."
        )
    return name


def _seconds(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def mark(name: str) -> bool:
    """Tell the emulated cluster that the program has reached ``name``.

    A fault with ``after=name`` (:class:`LinkDown`) counts its ``at`` from the
    first call, on any rank, so that it falls where the program is (e.g. before
    its third step) however long the start-up took. Later calls with the same
    name change nothing. The marker is a file in the folder
    ``$JAXSYNC_CLUSTER_MARKS`` that the cluster gives its ranks; outside a
    cluster run there is no such folder and nothing is done, so a training
    script may keep its calls.

    Args:
      name: the marker: a letter, then up to 63 letters, digits, ``.``, ``_``
        or ``-`` (e.g. ``"step-3"``).

    Returns:
      True inside a cluster run (the marker is there), False outside one.

    Raises:
      ValueError: ``name`` is not a marker name (also outside a cluster run).

    Example:
      >>> import jaxsync.cluster
      >>> for step in range(3):
      ...     _ = jaxsync.cluster.mark(f"step-{step}")  # ... then the step
      >>> jaxsync.cluster.mark("step-3")  # outside a cluster run: nothing to do
      False
    """
    _check_marker(name, "cluster.mark: name")
    folder = os.environ.get(MARKS_ENV)
    if not folder:
        return False
    path = os.path.join(folder, name)
    if os.path.exists(path):
        return True
    # Whole or not at all, and the first call wins: the time is written to a file
    # of this process's own, then linked to the marker's name (which fails if
    # another rank got there first), so the supervisor never reads a partial time.
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.{threading.get_ident()}")
    with open(tmp, "w") as f:
        f.write(f"{time.time()!r} {os.environ.get('PMI_RANK', '?')}\n")
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    return True


def read_mark(folder: Path, name: str) -> tuple[float, str] | None:
    """When ``name`` was first marked (seconds since the epoch) and by which rank, or None."""
    try:
        when, rank = (folder / name).read_text().split()
    except (OSError, ValueError):
        return None
    return float(when), rank


@dataclasses.dataclass(frozen=True, repr=False)
class LinkDown:
    """A fault: one host's link goes down at a time, for a while or for good.

    The time is ``at`` seconds after the launch, or, with ``after``, ``at``
    seconds after the program's first :func:`mark` of that name (on any rank).
    A marker follows the program: a fault ``after="step-3"`` falls before its
    third step however long the start-up took on a busy machine, where a fault
    ``at=10.0`` may come before the training even began. A marker that never
    comes does not hang anything: the fault never fires (the cluster says so at
    the end), and the run's own time limit (``timeout``) bounds the run.

    Attributes:
      host: the host's index (0 .. hosts-1).
      at: seconds after the launch (the clock in ``$JAXSYNC_CLUSTER_T0``), or
        after the marker ``after``; >= 0 (default 0).
      duration: seconds until the link comes back; ``None``: down for good.
      after: a marker name (see :func:`mark`), or ``None``: ``at`` counts from
        the launch.
      lost: the host is lost with its link (``--lose-host``): every process in
        it is killed (SIGKILL) as the link goes down, and it leaves the cluster's
        hostfile (``$JAXSYNC_CLUSTER_HOSTFILE``) until the link comes back.

    Raises:
      ValueError: a bad field (named in the message).

    Example:
      >>> from jaxsync.cluster import LinkDown
      >>> LinkDown(host=1, at=5.0, duration=2.0)  # 5 s after the launch, for 2 s
      LinkDown(host=1, at=5.0, duration=2.0)
      >>> LinkDown(host=1, after="step-3", duration=2.0)  # when a rank marks "step-3"
      LinkDown(host=1, at=0.0, duration=2.0, after='step-3')
      >>> LinkDown(host=2, after="step-5", lost=True)  # host 2 lost: its processes too
      LinkDown(host=2, at=0.0, duration=None, after='step-5', lost=True)
    """

    host: int
    at: float = 0.0
    duration: float | None = None
    after: str | None = None
    lost: bool = False

    def __post_init__(self):
        if not isinstance(self.host, int) or isinstance(self.host, bool) or self.host < 0:
            raise ValueError(
                f"jaxsync.cluster: LinkDown.host must be a host index >= 0, got {self.host!r}."
            )
        since = "the launch" if self.after is None else f"the marker {self.after!r}"
        if not (_seconds(self.at) and self.at >= 0):
            raise ValueError(
                f"jaxsync.cluster: LinkDown.at must be seconds >= 0 (after {since}), "
                f"got {self.at!r}. Fix: e.g. at=0.0 (at once), at=2.5."
            )
        if self.duration is not None and not (_seconds(self.duration) and self.duration > 0):
            raise ValueError(
                "jaxsync.cluster: LinkDown.duration must be seconds > 0, or None for a link "
                f"down for good, got {self.duration!r}. Fix: e.g. duration=2.0, or leave it out."
            )
        if self.after is not None:
            _check_marker(self.after, "cluster: LinkDown.after")
        if not isinstance(self.lost, bool):
            raise ValueError(f"jaxsync.cluster: LinkDown.lost must be a bool, got {self.lost!r}.")
        object.__setattr__(self, "at", float(self.at))
        if self.duration is not None:
            object.__setattr__(self, "duration", float(self.duration))

    def __repr__(self) -> str:
        after = "" if self.after is None else f", after={self.after!r}"
        after += ", lost=True" if self.lost else ""
        return f"LinkDown(host={self.host}, at={self.at!r}, duration={self.duration!r}{after})"

    @classmethod
    def parse(cls, text: str) -> LinkDown:
        """``HOST@WHEN`` (down for good) or ``HOST@WHEN+D`` (for D seconds), as the CLI takes it.

        ``WHEN`` is ``T`` (seconds after the launch), ``MARKER`` (when the program
        first marks it, see :func:`mark`) or ``MARKER:T`` (T seconds after that).

        Raises:
          ValueError: not one of these forms (the message gives examples).

        Example:
          >>> from jaxsync.cluster import LinkDown
          >>> LinkDown.parse("1@5+2"), LinkDown.parse("0@3")
          (LinkDown(host=1, at=5.0, duration=2.0), LinkDown(host=0, at=3.0, duration=None))
          >>> LinkDown.parse("1@step-3+2")  # when a rank marks "step-3", for 2 s
          LinkDown(host=1, at=0.0, duration=2.0, after='step-3')
          >>> LinkDown.parse("1@step-3:0.5")  # 0.5 s after it, for good
          LinkDown(host=1, at=0.5, duration=None, after='step-3')
        """
        m = _LINK_DOWN.match(str(text))
        if not m:
            raise ValueError(
                "jaxsync.cluster: --link-down must be HOST@SECONDS (after the launch), "
                "HOST@MARKER (when a rank calls jaxsync.cluster.mark(MARKER)) or "
                "HOST@MARKER:SECONDS (that many seconds after it), each down for good or "
                "with +DURATION, e.g. '1@5+2' or '1@step-3+2' (a marker begins with a "
                f"letter), got {text!r}."
            )
        host, marker, since, at, d = m.group("host", "marker", "since", "at", "d")
        return cls(
            host=int(host),
            at=float(at if marker is None else since or 0.0),
            duration=None if d is None else float(d),
            after=marker,
        )


_NUM = r"\d+(?:\.\d+)?"
_LINK_DOWN = re.compile(
    rf"^\s*(?P<host>\d+)\s*@\s*(?:(?P<marker>[A-Za-z][A-Za-z0-9._-]*)(?:\s*:\s*(?P<since>{_NUM}))?"
    rf"|(?P<at>{_NUM}))\s*(?:\+\s*(?P<d>{_NUM}))?\s*$"
)


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

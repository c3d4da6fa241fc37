"""A prototype of in-process recovery with ULFM: ``run(train_fn, state)``, ``State``.

Under Open MPI 5's ``mpirun --with-ft ulfm`` a lost process makes the survivors'
MPI calls fail (``MPI_ERR_PROC_FAILED``, or ``MPI_ERR_REVOKED`` once a peer revoked)
instead of killing them. :func:`run` catches that failure from ``train_fn``, revokes
the state's communicator and every private communicator jaxsync derived from it
(a process waiting in a host-local or per-device duplicate would otherwise never
hear of the loss), shrinks to the survivors, frees jaxsync's cached communicators for
the old world, restores the newest commit that every survivor holds, calls the reset
callbacks (where the user makes new transforms with ``comm=state.comm`` and re-jits)
and calls ``train_fn`` again.

A prototype (docs/elastic.md says what it does not do): transforms must be given
``comm=state.comm`` (``comm="auto"`` and ``topology()`` still mean ``COMM_WORLD``);
state that one rank alone holds (``sharded`` slices, a local island's inner state) is
not kept by a commit; overlap's and double buffering's in-flight work, the host tier's
pipelined requests and the exit drain are not failed explicitly.

Imports: jax, numpy, mpi4py (when called) and ``jaxsync._comm._topology``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

_FAILURE_TEXTS = ("MPI_ERR_PROC_FAILED", "MPI_ERR_REVOKED", "MPIX_ERR_PROC_FAILED")


def is_process_failure(e: BaseException) -> bool:
    """Whether ``e`` is an MPI process failure (ULFM), raised by mpi4py or jaxsync.

    Example:
      >>> from jaxsync.elastic._run import is_process_failure
      >>> is_process_failure(ValueError("jaxsync: MPI_Iallreduce failed: MPI_ERR_PROC_FAILED"))
      True
      >>> is_process_failure(ValueError("shapes differ"))
      False
    """
    MPI = sys.modules.get("mpi4py.MPI")  # not imported here: that would start MPI
    if MPI is not None and isinstance(e, MPI.Exception):
        cls = e.Get_error_class()
        return cls in (getattr(MPI, "ERR_PROC_FAILED", -1), getattr(MPI, "ERR_REVOKED", -1))
    return any(t in str(e) for t in _FAILURE_TEXTS)


class State:
    """What survives a lost process: named entries (pytrees) and the communicator.

    ``state.params``, ``state.step`` ... read and set the entries; :meth:`commit`
    copies them to host memory (after blocking on them: JAX dispatches
    asynchronously and a failure surfaces late). The last two commits are kept; on
    recovery every survivor restores the newest one all survivors hold (a failure
    during a commit leaves some ranks one commit ahead).

    Args:
      comm: the mpi4py communicator to train on (default ``MPI.COMM_WORLD``); after a
        recovery, ``state.comm`` is the shrunk one: give it to every transform.
      **entries: the pytrees to keep (parameters, optimizer state, step, data position).
    """

    comm: Any
    recoveries: int
    last_recovery: dict  # seconds per part of the last recovery (revoke ... reset)
    _entries: dict[str, Any]
    _commits: list[tuple[int, Any]]
    _resets: list[Callable[[State], None]]

    def __init__(self, comm: Any = None, **entries: Any) -> None:
        if comm is None:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
        object.__setattr__(self, "comm", comm)
        object.__setattr__(self, "_entries", dict(entries))
        object.__setattr__(self, "_commits", [])  # [(number, entries)], newest last
        object.__setattr__(self, "_resets", [])
        object.__setattr__(self, "recoveries", 0)
        object.__setattr__(self, "last_recovery", {})

    def __getattr__(self, name: str) -> Any:
        try:
            return self._entries[name]
        except KeyError:
            raise AttributeError(f"State has no entry {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("comm", "recoveries", "last_recovery") or name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            self._entries[name] = value

    @property
    def commits(self) -> int:
        """How many commits this process made (the newest one's number)."""
        return self._commits[-1][0] if self._commits else 0

    def commit(self) -> None:
        """Block on the entries and keep a host copy (never a donated buffer)."""
        import jax
        import numpy as np

        tree = jax.block_until_ready(self._entries)
        copy = jax.tree.map(lambda x: np.array(x, copy=True), jax.device_get(tree))
        self._commits = [*self._commits[-1:], (self.commits + 1, copy)]

    def on_reset(self, fn: Callable[[State], None]) -> Callable[[State], None]:
        """Register ``fn(state)``, called after a recovery (new transforms, data shard)."""
        self._resets.append(fn)
        return fn

    def _restore(self, number: int) -> None:
        import jax
        import numpy as np

        held = {n: e for n, e in self._commits}
        if number == 0:
            raise RuntimeError("jaxsync.elastic: a process was lost before the first commit")
        self._entries = jax.tree.map(lambda x: np.array(x, copy=True), held[number])
        self._commits = [(n, e) for n, e in self._commits if n <= number]


def _derived(comm: Any) -> list:
    """The user's communicator and every private one jaxsync made from it."""
    from jaxsync._comm._topology import Comms

    got = [comm]
    c = Comms._cache.get(id(comm))
    if c is not None and c.user is comm:
        got += [c.world, c.control, c.agreement, *c._devices]
        got += [wd.comm for wd in c._watchdogs.values()]
        got += [c._host] if c._host is not None else []
        if c._tier is not None:
            got += [*c._tier.host, *c._tier.cross, *c._tier_base]
    return got


def _forget(comm: Any) -> None:
    """Drop jaxsync's cached communicators of a revoked world (no drain: it is dead)."""
    from jaxsync._comm._topology import Comms

    c = Comms._cache.pop(id(comm), None)
    if c is not None:
        try:
            c.free()
        except Exception:  # noqa: BLE001 - a revoked handle may refuse; it is dropped
            pass


def recover(state: State) -> None:
    """Revoke, shrink, agree on the commit, restore, reset (every survivor calls it)."""
    import time

    from mpi4py import MPI

    t = [time.perf_counter()]
    old = state.comm
    for c in _derived(old):
        try:
            c.Revoke()
        except MPI.Exception:
            pass  # already revoked by a peer
    t.append(time.perf_counter())
    new = old.Shrink()
    _forget(old)
    t.append(time.perf_counter())
    # Survivors differ by at most one commit: the newest that all hold is the minimum.
    number = new.allreduce(state.commits, op=MPI.MIN)
    t.append(time.perf_counter())
    state.comm = new
    state.recoveries += 1
    state._restore(number)
    t.append(time.perf_counter())
    for fn in state._resets:
        fn(state)
    t.append(time.perf_counter())
    parts = ("revoke", "shrink", "agree", "restore", "reset")
    state.last_recovery = {k: t[i + 1] - t[i] for i, k in enumerate(parts)}
    state.last_recovery["restored_commit"] = number


def run(train_fn: Callable[[State], Any], state: State, max_recoveries: int = 8) -> Any:
    """Call ``train_fn(state)``; on a lost process recover and call it again.

    ``train_fn`` trains from ``state``'s entries (restored to the agreed commit after
    a recovery) and commits as it goes; its return value is returned. A failure that
    is not a process failure, or more than ``max_recoveries`` recoveries, is raised.
    """
    while True:
        try:
            return train_fn(state)
        except Exception as e:
            if not is_process_failure(e) or state.recoveries >= max_recoveries:
                raise
            recover(state)

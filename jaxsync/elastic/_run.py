"""In-process recovery with ULFM: ``run(train_fn, state)``, ``State``.

Under Open MPI 5's ``mpirun --with-ft ulfm`` a lost process makes the survivors'
MPI calls fail (``MPI_ERR_PROC_FAILED``, or ``MPI_ERR_REVOKED`` once a peer revoked)
instead of killing them. :func:`run` catches that failure from ``train_fn`` and
:func:`recover` stops the old world's stall watchdogs, revokes the state's
communicator and every private communicator jaxsync derived from it (a process
waiting in a host-local or per-device duplicate would otherwise never hear of the
loss), shrinks to the survivors, makes the shrunk communicator jaxsync's current
world (``comm="auto"``, ``topology()``, ``broadcast_params`` follow it), frees
jaxsync's cached communicators for the old world, agrees with ``Comm.Agree`` (fault
tolerant) on the newest commit every survivor holds, restores it (``sharded`` state
rebuilt from the ring copies, ``_shards``), calls the reset callbacks (where the user
makes new transforms and re-jits) and calls ``train_fn`` again. A process lost during
a recovery makes the recovery itself fail with a process failure: :func:`run`
recovers again, on the shrunk communicator.

The old world's in-flight lanes (streaming's ``overlap=True``) are failed, and the
islands split from it revoked. docs/elastic.md says what is lost (a lost island's
local steps, a lost rank's pending double-buffered gradients) and what is not
covered.

Imports: jax, numpy, mpi4py (when called), ``jaxsync._comm._topology``, ``_shards``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from . import _shards

_FAILURE_TEXTS = ("MPI_ERR_PROC_FAILED", "MPI_ERR_REVOKED", "MPIX_ERR_PROC_FAILED")
_FAILURE_CLASSES = ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
_WINDOW = 31  # Agree's flag: a bit per commit number modulo this (survivors differ by 1)


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
        return e.Get_error_class() in [getattr(MPI, c, -1) for c in _FAILURE_CLASSES]
    return any(t in str(e) for t in _FAILURE_TEXTS)


class State:
    """What survives a lost process: named entries (pytrees) and the communicator.

    ``state.params``, ``state.step`` ... read and set the entries; :meth:`commit`
    copies them to host memory (after blocking on them: JAX dispatches
    asynchronously and a failure surfaces late). The last two commits are kept; on
    recovery every survivor restores the newest one all survivors hold (a failure
    during a commit leaves some ranks one commit ahead), agreed with ``Comm.Agree``.

    Args:
      comm: the mpi4py communicator to train on (default ``MPI.COMM_WORLD``); after a
        recovery, ``state.comm`` is the shrunk one. When it is the job's world,
        ``comm="auto"`` follows it too (transforms made in a reset callback with
        ``comm="auto"`` run on the survivors).
      sharded: entries that hold a :class:`jaxsync.ShardedState` (state that this
        rank alone holds, 1/N of it), as ``{name: (inner, params_name)}``: the
        optimizer given to :func:`jaxsync.sharded` and the entry holding the
        parameters. Each commit also sends this rank's slices to its ring neighbour
        (rank + 1, on ``comm`` with tag 7201), which keeps them: one extra slice set
        per rank. A recovery
        rebuilds the whole state from the survivors' copies and cuts it for the new
        world (:func:`jaxsync.shard_state`, ``jax.local_device_count()`` replicas per
        process).
      **entries: the pytrees to keep (parameters, optimizer state, step, data position).

    Example:
      >>> import numpy as np
      >>> from jaxsync.elastic import State
      >>> s = State(comm=object(), w=np.zeros(2), t=0)  # comm: an mpi4py communicator
      >>> s.w, s.t = s.w + 1.0, 1
      >>> s.commit()  # a host copy of w and t (after blocking on them)
      >>> s.commits
      1
    """

    comm: Any
    recoveries: int
    last_recovery: dict  # seconds per part of the last recovery (revoke ... reset)
    _entries: dict[str, Any]
    _commits: list[tuple[int, Any, Any]]  # (number, entries, ring record), newest last
    _resets: list[Callable[[State], None]]
    _sharded: dict[str, tuple[Any, str]]

    def __init__(self, comm: Any = None, *, sharded: dict | None = None, **entries: Any) -> None:
        if comm is None:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
        spec = dict(sharded or {})
        for name, v in spec.items():
            ok = isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], str)
            if not ok or name not in entries or v[1] not in entries:
                raise ValueError(
                    f"State: sharded[{name!r}] = {v!r}; expected (inner, params_name) with "
                    f"{name!r} and params_name entries of the state (got entries "
                    f"{sorted(entries)}). Fix: State(comm, params=p, opt=s, "
                    "sharded={'opt': (inner, 'params')})."
                )
        object.__setattr__(self, "comm", comm)
        object.__setattr__(self, "_entries", dict(entries))
        object.__setattr__(self, "_commits", [])
        object.__setattr__(self, "_resets", [])
        object.__setattr__(self, "_sharded", spec)
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
        """Block on the entries and keep a host copy (never a donated buffer).

        With ``sharded`` entries, also a collective over ``state.comm``: the ring
        copy of this rank's slices (it counts only once the neighbour's arrived).
        A local-update state with a fragment's mean in flight (``overlap=True``)
        waits for it and keeps its sum (``jaxsync.local.in_flight``): a restore
        puts it back in flight in the new world.
        """
        import jax

        tree = jax.block_until_ready(self._entries)
        copy = jax.tree.map(_host, jax.device_get(tree))
        flying = _flying(tree)
        if flying:  # streaming's sums in flight, waited for: a restore resumes them
            copy[_IN_FLIGHT] = flying
        ring = None
        if self._sharded:
            left = _shards.ring_copy(self.comm, {n: copy[n] for n in self._sharded})
            c = self.comm
            ring = {"gen": self.recoveries, "size": c.Get_size(), "rank": c.Get_rank()}
            ring["left"] = left
        self._commits = [*self._commits[-1:], (self.commits + 1, copy, ring)]

    def on_reset(self, fn: Callable[[State], None]) -> Callable[[State], None]:
        """Register ``fn(state)``, called after a recovery (new transforms, data shard)."""
        self._resets.append(fn)
        return fn

    def _restore(self, number: int) -> None:
        """Restore commit ``number`` (agreed), rebuilding sharded entries for this world."""
        import jax

        entries, ring = {n: (e, r) for n, e, r in self._commits}[number]  # KeyError: gone
        entries = jax.tree.map(_host, entries)
        flying = entries.pop(_IN_FLIGHT, {})
        if self._sharded:
            new, left = _shards.rebuild(self.comm, ring, entries, self._sharded)
            entries.update(new)
            c = self.comm
            ring = {"gen": self.recoveries, "size": c.Get_size(), "rank": c.Get_rank()}
            ring["left"] = left  # the new world's ring: a second loss is covered too
        self._commits = [c for c in self._commits if c[0] < number]
        kept = jax.tree.map(_host, entries)
        if flying:
            kept[_IN_FLIGHT] = flying
            from jaxsync.local import _resume

            for name, saved in flying.items():  # in flight again, in this process
                entries[name] = _resume.resume_in_flight(entries[name], saved)
        self._commits.append((number, kept, ring))
        self._entries = entries


_IN_FLIGHT = "__jaxsync_in_flight__"  # a commit's saved sums in flight, by entry


def _flying(tree: dict) -> dict:
    """Each entry's sums in flight (``overlap=True`` local updates), waited for."""
    mod = sys.modules.get("jaxsync.local._resume")
    if mod is None:
        return {}
    return {name: mod.in_flight(v) for name, v in tree.items() if mod.has_sums(v)}


def _host(x: Any) -> Any:
    import numpy as np

    return np.array(x, copy=True)


def newest_common(held: list[int], agreed: int) -> int | None:
    """The newest of this process's commit numbers whose bit is in ``agreed``.

    Each survivor's flag has bit ``n % 31`` set for every commit ``n`` it holds (its
    last two); ``Comm.Agree`` ANDs them, so the bits left are the commits all hold.
    Survivors differ by at most one commit, so the bits name the same numbers on all.

    Example:
      >>> from jaxsync.elastic._run import flag, newest_common
      >>> newest_common([6, 7], flag([6, 7]) & flag([5, 6]))  # one rank is a commit behind
      6
      >>> newest_common([6, 7], flag([6, 7]) & flag([]))  # one holds none: nothing common
    """
    common = [n for n in held if agreed >> (n % _WINDOW) & 1]
    return max(common) if common else None


def flag(held: list[int]) -> int:
    """This process's flag for ``Comm.Agree``: a bit per commit number it holds."""
    out = 0
    for n in held:
        out |= 1 << (n % _WINDOW)
    return out


def agree_commit(comm: Any, held: list[int]) -> int:
    """The newest commit every process of ``comm`` holds (``Comm.Agree``: fault tolerant).

    Raises:
      RuntimeError: no commit is held by all (a process was lost before its first).
    """
    number = newest_common(held, comm.Agree(flag(held)))
    if number is None:
        raise RuntimeError(
            "jaxsync.elastic: no commit is held by every survivor (a process was lost "
            "before the first state.commit()). Fix: commit once before training."
        )
    return number


def _derived(comm: Any) -> list:
    """The user's communicator and every private one jaxsync made from it: its
    ``Comms``, the islands split from it (``jaxsync.islands``: the island and the
    outer communicators, and their ``Comms``) and their in-flight lanes' duplicates."""
    from jaxsync._comm._topology import Comms

    got = [comm]
    for user in [comm, *_island_comms(comm)]:
        got += [user] if user is not comm else []
        c = Comms._cache.get(id(user))
        if c is not None and c.user is user:
            got += [c.world, c.control, c.agreement, *c._devices]
            got += [wd.comm for wd in c._watchdogs.values()]
            got += [c._host] if c._host is not None else []
            if c._tier is not None:
                got += [*c._tier.host, *c._tier.cross, *c._tier_base]
    got += [ln.comm for ln in _lanes(got)]
    return got


def _island_comms(comm: Any) -> list:
    """The communicators ``jaxsync.islands(..., comm=comm)`` split from ``comm``."""
    made = getattr(sys.modules.get("jaxsync.local._islands"), "_MADE", {})
    out = []
    for (key, _), (world, isl) in list(made.items()):
        if key == id(comm) and world is comm:
            out += [c for c in (isl.comm, isl.outer_comm) if hasattr(c, "Revoke")]
    return out


def _lanes(comms: list) -> list:
    """The in-flight lanes (streaming's ``overlap=True``) on any of ``comms``."""
    lanes = getattr(sys.modules.get("jaxsync.local._inflight"), "_LANES", {})
    return [ln for c, ln in list(lanes.values()) if any(c is x for x in comms)]


def _fail_lanes(comm: Any, exc: BaseException) -> None:
    """Fail the old world's lanes (pending transfers raise ``exc``) and forget them,
    with the islands split from it: a transform made after the recovery makes new ones."""
    comms = [comm, *_island_comms(comm)]
    if _lanes(comms):  # every sum in flight in this process (the native lanes')
        sys.modules["jaxsync.local._inflight"].fail_all(str(exc))
    lanes = getattr(sys.modules.get("jaxsync.local._inflight"), "_LANES", {})
    for k, (c, _) in list(lanes.items()):
        if any(c is x for x in comms):
            lanes.pop(k, None)
    made = getattr(sys.modules.get("jaxsync.local._islands"), "_MADE", {})
    for k, (world, _) in list(made.items()):
        if world is comm:
            made.pop(k, None)
    for c in comms[1:]:
        _forget(c)


def _stop_watchdogs(comm: Any) -> None:
    """Stop the old world's stall watchdogs first: a stage that the failure left open
    must not be reported, nor end the job (``on_timeout="abort"``), while recovering."""
    from jaxsync._comm._topology import Comms

    for user in [comm, *_island_comms(comm)]:
        c = Comms._cache.get(id(user))
        if c is not None and c.user is user:
            for wd in c._watchdogs.values():
                wd._stop.set()  # the thread sees it within one poll; not joined here


_LOST = (
    "jaxsync.elastic: a process of the {}-process world was lost while this transfer "
    "was in flight (overlap=True): MPI_ERR_REVOKED, the world was revoked and "
    "recovered. Fix: nothing: the recovery restores a commit and calls train_fn again."
)
_DEAD: list = []  # the revoked worlds' jaxsync communicators: kept, never freed


def _forget(comm: Any) -> None:
    """Drop jaxsync's cached communicators of a revoked world; no drain: it is dead.

    Their watchdogs are stopped; the handles are revoked, not freed: a nonblocking
    call still queued on a communicator's worker thread names its handle, and fails
    on a revoked one (``MPI_ERR_REVOKED``) where a freed one would be undefined.
    """
    from jaxsync._comm._topology import Comms

    c = Comms._cache.pop(id(comm), None)
    if c is not None:
        for wd in c._watchdogs.values():
            wd.stop()
        c.freed = True  # the exit hook does not free them either
        _DEAD.append(c)


def recover(state: State) -> None:
    """Revoke, shrink, agree on the commit, restore, reset (every survivor calls it).

    A process failure during it is raised (:func:`run` recovers again, from the
    shrunk communicator, which ``state.comm`` already is).
    """
    import time

    from mpi4py import MPI

    from jaxsync._comm import _topology

    state.recoveries += 1
    t = [time.perf_counter()]
    old = state.comm
    follows = old is _topology.current_world()
    _stop_watchdogs(old)
    for c in _derived(old):
        try:
            c.Revoke()
        except MPI.Exception:
            pass  # already revoked by a peer
    _fail_lanes(old, RuntimeError(_LOST.format(old.Get_size())))
    t.append(time.perf_counter())
    new = old.Shrink()
    state.comm = new
    if follows:
        _topology.set_current_world(new)
    _forget(old)
    t.append(time.perf_counter())
    number = agree_commit(new, [n for n, _, _ in state._commits])
    t.append(time.perf_counter())
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
    a recovery) and commits as it goes; its return value is returned. A process lost
    during a recovery starts another one. A failure that is not a process failure
    (e.g. :class:`SlicesLost`: two ring neighbours lost together), or a recovery
    beyond ``max_recoveries``, is raised.
    """
    while True:
        try:
            return train_fn(state)
        except Exception as e:
            if not is_process_failure(e) or state.recoveries >= max_recoveries:
                raise
        while True:
            try:
                recover(state)
                break
            except Exception as e:
                if not is_process_failure(e) or state.recoveries >= max_recoveries:
                    raise

"""Islands: the groups of devices and processes that synchronise every step,
and the guard that keeps an inner mean inside its island.

An island's inner chain averages over ``Islands.axis_name`` and ``Islands.comm``
only; islands exchange only in the outer mean (``Islands.outer_comm``). The guard
(:func:`guard`) is registered with the core (``_plugins.register_sync_check``):
while a local-update transform traces its inner chain, any jaxsync mean whose
axes or communicator reach past the island is refused.

May import: ``_comm`` (``AxisComm``, ``default_comm``), ``_core._plugins``; JAX.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
from typing import Any

from jax import lax

from jaxsync._comm._axis_backend import AxisComm
from jaxsync._comm._topology import default_comm
from jaxsync._core import _plugins

_KINDS = ("host", "process")
_MADE: dict = {}  # (id(comm), kind) -> (comm, Islands): the split communicators, kept


@dataclasses.dataclass(frozen=True, eq=False)
class Islands:
    """Where the islands are, as :func:`jaxsync.islands` found them.

    Attributes:
      kind: ``"host"``, ``"process"``, ``"comm"`` (a communicator given) or
        ``"axis"`` (a mesh axis).
      axis_name: the replicas' mesh axis name(s) inside this process (the
        island's part of the mesh); pass it to the inner chain's mean.
      comm: the island's inter-process stage for the inner chain's mean: an
        mpi4py communicator of this island's processes, or ``None`` (the island
        is this process, or the islands are a mesh axis in one process).
      outer_comm: the stage the outer mean crosses islands on: an mpi4py
        communicator of this process and its same-rank peers in the other
        islands, a :class:`jaxsync.AxisComm` (mesh islands), or ``None`` (one
        island).
      count: the number of islands (``None`` for a mesh axis: its size).
      index: this process's island (``None`` for a mesh axis).
      island_axis: the mesh axis that indexes the islands (``None``: islands
        across processes).
      world: every process of the job, the communicator the islands were split
        from (``comm``), or ``None`` (one process, or a mesh axis): a local-update
        transform checks on it that every process has the same configuration.
    """

    kind: str
    axis_name: Any
    comm: Any
    outer_comm: Any
    count: int | None
    index: int | None
    island_axis: str | None = None
    world: Any = None

    def size(self) -> int:
        """The number of islands (a mesh axis: its size, while traced)."""
        if self.island_axis is not None:
            return int(lax.axis_size(self.island_axis))
        assert self.count is not None
        return self.count

    def describe(self) -> str:
        return f"islands {self.kind} count {self.count} axis {self.island_axis}"


def islands(islands: Any = "host", *, axis_name: Any = None, comm: Any = "auto") -> Islands:
    """Choose the islands of a local-update method (:func:`jaxsync.diloco`).

    An island is a group of devices and processes that synchronises every step
    (the inner chain's mean); islands exchange parameters only every ``H``
    steps (the outer mean). Collective over ``comm`` (every process calls it).

    The outer mean runs on every process, each with its same-rank peers in the
    other islands (``outer_comm``), not on one leader per island: every process
    of an island holds the same parameters, so each such group computes the
    whole mean, the traffic is spread over every process's link, and no
    broadcast inside the island follows. Every island must therefore have the
    same number of processes (checked here, on every process).

    Args:
      islands: ``"host"`` (default: one island per host, from the topology),
        ``"process"`` (one per process: ``mpirun -n 2`` on one machine has two),
        an mpi4py communicator of this process's island (each process passes
        its own island's), or a :class:`jaxsync.AxisComm` naming the mesh axis
        that indexes the islands (e.g. a ``("island", "replica")`` mesh under
        ``shard_map``: several islands in one process).
      axis_name: the replicas' mesh axis name(s) inside one island and process
        (as for :func:`jaxsync.mean`); ``None``: one device.
      comm: every process of the job (``"auto"``: ``MPI.COMM_WORLD`` under MPI
        with several processes, else ``None``). With mesh islands, the
        processes an island spans.

    Returns:
      an :class:`jaxsync.Islands`: pass ``isl.axis_name`` and ``isl.comm`` to
      the inner chain's mean, and ``isl`` to :func:`jaxsync.diloco`.

    Example:
      >>> import jaxsync
      >>> isl = jaxsync.islands("process", axis_name="i", comm=None)
      >>> (isl.count, isl.comm, isl.outer_comm)
      (1, None, None)
    """
    if isinstance(comm, str) and comm == "auto":
        comm = default_comm()
    if isinstance(islands, AxisComm):
        return Islands("axis", axis_name, comm, islands, None, None, islands.axis_name)
    if isinstance(islands, str) and islands in _KINDS:
        if comm is None:
            return Islands(islands, axis_name, None, None, 1, 0)
        from mpi4py import MPI as _MPI

        key = (id(comm), islands)
        if key not in _MADE or _MADE[key][0] is not comm:  # once per communicator
            rank = comm.Get_rank()
            if islands == "process":
                island = comm.Split(rank, key=0)  # a communicator of one
            else:
                island = comm.Split_type(_MPI.COMM_TYPE_SHARED, key=rank)
            _MADE[key] = (comm, _from_island(islands, None, comm, island))
        return dataclasses.replace(_MADE[key][1], axis_name=axis_name)
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None and isinstance(islands, MPI.Intracomm):
        if comm is None:
            raise ValueError(
                "islands: an island communicator was given but comm=None (one "
                "process). Fix: pass comm=MPI.COMM_WORLD (every process of the job)."
            )
        got = _from_island("comm", axis_name, comm, islands)
        # kept with the split ones: an elastic recovery revokes every island of a lost world
        _MADE[(id(comm), ("comm", id(islands), len(_MADE)))] = (comm, got)
        return got
    raise TypeError(
        "islands got unexpected type for argument 'islands' (expected: 'host', "
        "'process', an mpi4py Intracomm or jaxsync.AxisComm, got: "
        f"{islands!r}). Fix: islands='host', islands='process', "
        "islands=MPI.COMM_WORLD.Split(color, key) or islands=jaxsync.AxisComm('island')."
    )


def _from_island(kind: str, axis_name, world, island) -> Islands:
    rank = world.Get_rank()
    leader = island.bcast(rank, root=0)
    sizes = world.allgather((leader, island.Get_size()))
    leaders = sorted({lead for lead, _ in sizes})
    counts = sorted({n for _, n in sizes})
    if len(counts) > 1:  # every process sees the same list: all raise together
        raise ValueError(
            f"islands={kind!r}: the islands have different numbers of processes "
            f"{counts}; the outer mean pairs each process with its same-rank peers, "
            "so every island needs as many. Fix: launch the same number of "
            "processes per host, or pass islands='process'."
        )
    outer = world.Split(island.Get_rank(), key=rank)
    inner = island if island.Get_size() > 1 else None
    count = len(leaders)
    return Islands(
        kind,
        axis_name,
        inner,
        outer if count > 1 else None,
        count,
        leaders.index(leader),
        world=world,
    )


_ACTIVE: contextvars.ContextVar[Islands | None] = contextvars.ContextVar(
    "jaxsync_islands", default=None
)


@contextlib.contextmanager
def guard(isl: Islands, fn: str):
    """While active, a jaxsync mean that spans islands raises (see ``check``)."""
    token = _ACTIVE.set(dataclasses.replace(isl, kind=f"{isl.kind}:{fn}"))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def check(cfg) -> None:
    """Refuse a synchronisation (its ``SyncConfig``) that reaches past the island."""
    isl = _ACTIVE.get()
    if isl is None:
        return
    fn = isl.kind.partition(":")[2]
    axes = tuple(cfg.axes) + tuple(getattr(cfg.backend, "mesh_axes", ()))
    what = None
    if isl.island_axis is not None and isl.island_axis in axes:
        what = f"the mesh axis {isl.island_axis!r} that indexes the islands"
    comms = getattr(cfg.backend, "comms", None)
    if what is None and comms is not None and not _inside(comms.user, isl.comm):
        what = f"a communicator of {comms.size} processes beyond the island's"
    if what is not None:
        raise ValueError(
            f"{fn}: the inner chain's mean ({cfg.strategy}) spans {what}: it would "
            "average every step across islands, turning the method back into data "
            "parallel with extra traffic. Fix: build the inner mean with "
            "axis_name=isl.axis_name, comm=isl.comm (isl = jaxsync.islands(...))."
        )


def _inside(comm, island) -> bool:
    """Whether every process of ``comm`` belongs to ``island`` (None: this one)."""
    from mpi4py import MPI

    if island is None:
        return comm.Get_size() == 1
    ranks = MPI.Group.Translate_ranks(
        comm.Get_group(), list(range(comm.Get_size())), island.Get_group()
    )
    return all(r != MPI.UNDEFINED for r in ranks)


_plugins.register_sync_check(check)

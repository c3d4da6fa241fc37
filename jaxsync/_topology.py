"""Who is where: processes, hosts, local devices and per-device communicators."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from typing import Any

import jax

_MPI_ENV = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK",
            "MPI_LOCALNRANKS", "MV2_COMM_WORLD_SIZE", "HYDI_CONTROL_FD")


def launched_by_mpi() -> bool:
    """True when this process looks started by ``mpirun``/``mpiexec``/``srun --mpi``."""
    return "mpi4py.MPI" in sys.modules or any(k in os.environ for k in _MPI_ENV)


def default_comm():
    """``MPI.COMM_WORLD`` when MPI is in use with more than one process, else None.

    mpi4py is imported only when this process was started by an MPI launcher
    (or mpi4py is already imported), so a notebook never initialises MPI by
    accident.
    """
    if not launched_by_mpi():
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI.COMM_WORLD if MPI.COMM_WORLD.Get_size() > 1 else None


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where this process sits.

    Attributes:
      rank: this process's rank in the communicator (0 without MPI).
      size: number of processes.
      host: index of this process's host (shared-memory node).
      hosts: number of hosts.
      local_rank: rank among the processes on this host.
      local_size: number of processes on this host.
      local_devices: number of JAX devices this process drives.
      platform: the JAX backend platform.
    """

    rank: int
    size: int
    host: int
    hosts: int
    local_rank: int
    local_size: int
    local_devices: int
    platform: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def topology(comm: Any = "auto") -> Topology:
    """Describe this process's place among processes, hosts and devices.

    Collective over ``comm``: every process must call it.

    Args:
      comm: an mpi4py communicator, ``None`` for a single process, or ``"auto"``
        (``MPI.COMM_WORLD`` when launched by MPI with several processes).

    Example:
      >>> import jaxsync
      >>> t = jaxsync.topology(comm=None)
      >>> (t.rank, t.size, t.hosts, t.local_devices)
      (0, 1, 1, 8)
    """
    if isinstance(comm, str) and comm == "auto":
        comm = default_comm()
    ndev = jax.local_device_count()
    platform = jax.default_backend()
    if comm is None:
        return Topology(0, 1, 0, 1, 0, 1, ndev, platform)
    comms = Comms.of(comm)
    hostcomm = comms.host
    rank, size = comm.Get_rank(), comm.Get_size()
    local_rank, local_size = hostcomm.Get_rank(), hostcomm.Get_size()
    leader = hostcomm.bcast(rank, root=0)        # lowest rank on my host
    leaders = comms.control.allgather(leader)
    hosts = sorted(set(leaders))
    return Topology(rank, size, hosts.index(leader), len(hosts), local_rank, local_size,
                    ndev, platform)


class Comms:
    """Private duplicates of a user communicator, made once and cached.

    jaxsync never sends on the user's communicator itself, so its messages can
    not be confused with the user's own MPI traffic.

    Creating them is collective over ``comm``; it happens when a transform is
    first traced, which every process does at the same point of its program.
    """

    _cache: dict = {}

    def __init__(self, comm):
        self.user = comm
        self.world = comm.Dup()      # collectives inside compiled steps
        self.control = comm.Dup()    # Python-level checks, never concurrent with steps
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self._per_device: dict[int, tuple] = {}
        self._watchdogs: dict = {}

    @classmethod
    def of(cls, comm) -> "Comms":
        key = id(comm)
        if key not in cls._cache:
            cls._cache[key] = cls(comm)
        return cls._cache[key]

    def watchdog(self, timeout: float):
        """The stall watchdog of this communicator (one per timeout value)."""
        from ._watchdog import Watchdog
        key = float(timeout)
        if key not in self._watchdogs:
            self._watchdogs[key] = Watchdog(self.control.Dup(), key)
        return self._watchdogs[key]

    @functools.cached_property
    def host(self):
        """The processes on this host (MPI shared-memory split)."""
        from mpi4py import MPI
        return self.control.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)

    def per_device(self, n: int) -> tuple:
        """``n`` communicators: the world split by local device index."""
        if n not in self._per_device:
            counts = self.control.allgather(n)
            if len(set(counts)) != 1:
                raise ValueError(
                    "every process must drive the same number of local devices in the "
                    f"synchronised axes; got {dict(enumerate(counts))} (rank: devices). "
                    "Fix: launch every process with the same device count.")
            self._per_device[n] = tuple(
                self.control.Split(color=k, key=self.rank) for k in range(n))
        return self._per_device[n]

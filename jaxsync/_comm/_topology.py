"""Who is where: processes, hosts, local devices and per-device communicators."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from typing import Any

import jax

from . import _host_tier

_MPI_ENV = (
    "PMI_SIZE",
    "PMI_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMIX_RANK",
    "MPI_LOCALNRANKS",
    "MV2_COMM_WORLD_SIZE",
    "HYDI_CONTROL_FD",
)


def launched_by_mpi() -> bool:
    """True when this process looks started by ``mpirun``/``mpiexec``/``srun --mpi``."""
    return "mpi4py.MPI" in sys.modules or any(k in os.environ for k in _MPI_ENV)


# The launcher's own process count: more than one means this process was started
# as one of several MPI ranks, whatever MPI itself says.
_LAUNCHER_SIZE_ENV = (
    "PMI_SIZE",
    "OMPI_COMM_WORLD_SIZE",
    "MV2_COMM_WORLD_SIZE",
    "PMIX_SIZE",
    "MPI_LOCALNRANKS",
)


def _launcher_sizes() -> dict:
    """The launcher size variables set in the environment with a value > 1."""
    seen = {}
    for k in _LAUNCHER_SIZE_ENV:
        try:
            if int(os.environ.get(k, "")) > 1:
                seen[k] = os.environ[k]
        except ValueError:
            pass
    return seen


class LaunchError(RuntimeError):
    """An MPI launcher started several processes but MPI sees only one."""


def _srun_tasks_without_mpi() -> int:
    """srun's task count where it started several tasks of this step without MPI
    wiring (no PMI/PMIx variable) and ``jax.distributed`` is not initialised; else 0."""
    try:
        tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", ""))
    except ValueError:
        return 0
    if tasks <= 1 or any(k in os.environ for k in (*_MPI_ENV, "PMIX_SIZE", "PMI_FD")):
        return 0
    try:  # jax.distributed's processes: comm=None is theirs to choose (a global mesh)
        from jax._src import distributed

        if distributed.global_state.client is not None:
            return 0
    except (ImportError, AttributeError):
        pass
    return tasks


def set_cpu_devices(n: int, command: str) -> None:
    """Ask for ``n`` CPU devices (``--devices`` of ``python -m jaxsync <command>``).

    Must happen before JAX initialises its backends; if it already has, with
    another count, the command stops (``SystemExit``) saying how to start again.
    """
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        if jax.local_device_count() != n:
            raise SystemExit(
                f"jaxsync {command}: JAX is already initialised with "
                f"{jax.local_device_count()} device(s), --devices asks for {n}. Start a "
                f"fresh process, or set XLA_FLAGS=--xla_force_host_platform_device_count={n} "
                "before JAX starts."
            ) from None


def default_comm() -> Any:
    """``MPI.COMM_WORLD`` when MPI is in use with more than one process, else None.

    This is the communicator ``comm="auto"`` resolves to; after an in-process
    recovery (``jaxsync.elastic.run``), the survivors' shrunk one instead
    (``None`` when one survivor is left). mpi4py is imported only
    when this process was started by an MPI launcher (or mpi4py is already
    imported), so a notebook never initialises MPI by accident.

    Returns:
      ``mpi4py.MPI.COMM_WORLD``, or ``None`` (not launched by MPI, or one process).

    Raises:
      LaunchError: the launcher says there are several processes (``PMI_SIZE``,
        ``OMPI_COMM_WORLD_SIZE``, ... > 1) but mpi4py cannot be imported or its
        ``COMM_WORLD`` has a single process (mpi4py built against another MPI
        than the launcher's, PMI not wired): every process would otherwise train
        alone without a word. ``mpirun -n 1`` is fine (size 1 both ways). Likewise
        under ``srun`` with several tasks and no MPI wiring (``--mpi=none``), unless
        ``jax.distributed`` is initialised.

    Example:
      >>> import jaxsync
      >>> jaxsync.default_comm() is None  # one process, not under mpirun
      True
    """
    if _WORLD:  # the survivors' communicator after an in-process recovery
        return _WORLD[0] if _WORLD[0].Get_size() > 1 else None
    tasks = _srun_tasks_without_mpi()
    if tasks:
        raise LaunchError(
            f"jaxsync: comm='auto' runs in one of {tasks} tasks that srun started "
            f"(SLURM_STEP_NUM_TASKS={tasks}) with no MPI wiring (no PMI_*/PMIX_* "
            "variables: srun --mpi=none, or the cluster's MpiDefault=none), so every "
            "process would train alone. Fix: srun --mpi=pmi2 (the mpich wheel; "
            "--mpi=pmix for an Open MPI built with PMIx), or initialise "
            "jax.distributed and pass comm=jaxsync.AxisComm(...), or pass comm=None "
            "to train each process on its own on purpose."
        )
    if not launched_by_mpi():
        return None
    sizes = _launcher_sizes()
    seen = ", ".join(f"{k}={v}" for k, v in sizes.items())
    try:
        from mpi4py import MPI
    except ImportError as e:
        if sizes:
            raise LaunchError(
                f"jaxsync: comm='auto' found an MPI launcher with several processes "
                f"({seen}) but mpi4py cannot be imported ({e}); every process would "
                "train alone. Fix: install mpi4py built against the launcher's MPI "
                "(pip install 'jaxsync[mpi]'), or pass comm=None to train each "
                "process on its own on purpose."
            ) from e
        return None
    size = MPI.COMM_WORLD.Get_size()
    if size == 1 and sizes:
        raise LaunchError(
            f"jaxsync: comm='auto' found an MPI launcher with several processes "
            f"({seen}) but MPI.COMM_WORLD has 1 process: mpi4py's MPI is not the "
            "launcher's (PMI not wired), so every process would train alone. Fix: "
            "launch with the mpirun/mpiexec of the MPI that mpi4py was built with "
            "(python -c 'import mpi4py; print(mpi4py.get_config())'), or pass "
            "comm=None to train each process on its own on purpose."
        )
    return MPI.COMM_WORLD if size > 1 else None


_WORLD: list = []  # [comm]: the current world, once jaxsync.elastic recovered


def set_current_world(comm: Any) -> None:
    """Make ``comm`` what ``comm="auto"`` means from now on (``None``: COMM_WORLD again).

    Set by ``jaxsync.elastic``'s recovery to the shrunk communicator of the survivors
    (``MPI.COMM_WORLD`` itself cannot be replaced); :func:`default_comm`, and so
    ``comm="auto"``, ``topology()`` and ``broadcast_params``, follow it.
    """
    _WORLD[:] = [] if comm is None else [comm]


def current_world() -> Any:
    """The communicator of the job's processes: the current world if one was set,
    else ``MPI.COMM_WORLD`` (imports mpi4py)."""
    if _WORLD:
        return _WORLD[0]
    from mpi4py import MPI

    return MPI.COMM_WORLD


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

    Returns:
      a :class:`jaxsync.Topology`: rank and size, the host index and count, the
      rank and size on this host, the local device count and the platform.

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
    leader = hostcomm.bcast(rank, root=0)  # lowest rank on my host
    leaders = comms.control.allgather(leader)
    hosts = sorted(set(leaders))
    return Topology(
        rank, size, hosts.index(leader), len(hosts), local_rank, local_size, ndev, platform
    )


class Comms:
    """Private duplicates of a user communicator, made once and cached.

    jaxsync never sends on the user's communicator itself, so its messages can
    not be confused with the user's own MPI traffic.

    Creating them is collective over ``comm``: it happens when a transform is
    made (the factory call), or ``broadcast_params``/``topology`` is called, on
    every process - never while a step is traced, which a process may do alone.
    They are freed by :func:`free_communicators` or at exit (before
    ``MPI_Finalize``).
    """

    _cache: dict = {}

    def __init__(self, comm: Any) -> None:
        self.user = comm
        self.world = comm.Dup()  # collectives inside compiled steps
        self.control = comm.Dup()  # Python-level checks, never concurrent with steps
        self.agreement = comm.Dup()  # in-step agreement callbacks (see _agree)
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self._devices: list = []  # per-device duplicates, made by prepare()
        self._watchdogs: dict = {}
        self._host = None
        self._tier: _host_tier.HostTier | None = None
        self._tier_base: tuple = ()  # (host, cross) communicators, once decided
        self._tier_decided = False
        self.hosts = 0  # hosts the communicator spans (set by prepare, collectively)
        self.freed = False
        _register_atexit()

    @classmethod
    def of(cls, comm) -> Comms:
        key = id(comm)
        got = cls._cache.get(key)
        if got is None or got.user is not comm:
            got = cls._cache[key] = cls(comm)
        return got

    def prepare(self, n: int) -> None:
        """Make per-device communicators for ``n`` local devices now.

        Collective over the user's communicator: every process makes as many as
        the process with the most devices (processes may differ; that is caught
        before the first reduction, see ``per_device``).
        """
        if n <= len(self._devices):
            return
        from mpi4py import MPI

        n = self.control.allreduce(n, op=MPI.MAX)
        while len(self._devices) < n:
            self._devices.append(self.control.Dup())
        self._prepare_tier(n)

    def _prepare_tier(self, n: int) -> None:
        """Decide the host tier (collectively, once) and make its ``n`` device pairs."""
        if not self._tier_decided:
            self._tier_decided = True
            self._tier, self._tier_base, self.hosts = _host_tier.decide(self.control, self.rank)
        if self._tier is not None:
            self._tier = _host_tier.extend(self._tier, self._tier_base, n)

    @property
    def tier(self) -> _host_tier.HostTier | None:
        """The host tier (see :class:`HostTier`), or None: one host, or one
        process per host, or forced off (``JAXSYNC_HOST_TIER=0``). Whether a
        synchronisation uses it is its ``host_tier`` option (``_host_tier.chosen``)."""
        return self._tier

    def watchdog(self, timeout: float, on_timeout: str = "report"):
        """The stall watchdog of this communicator (one per timeout and action)."""
        from ._watchdog import Watchdog

        key = (float(timeout), on_timeout)
        if key not in self._watchdogs:
            self._watchdogs[key] = Watchdog(self.control.Dup(), key[0], on_timeout)
        return self._watchdogs[key]

    @property
    def host(self):
        """The processes on this host (MPI shared-memory split)."""
        if self._host is None:
            from mpi4py import MPI

            self._host = self.control.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        return self._host

    def per_device(self, n: int) -> tuple:
        """``n`` communicators, one per local device index (no communication).

        Each is a duplicate of the world, made by :meth:`prepare` when the
        transform was made (for every local device). That every process drives
        the same number of devices is checked with the rest of the gradient
        tree's description, before the first reduction.
        """
        if n > len(self._devices):
            # More replicas per process than local devices (not a shard_map/pmap
            # over local devices): made here, collectively, at trace time.
            self.prepare(n)
        return tuple(self._devices[:n])

    def free(self) -> None:
        """Stop the watchdogs and free every duplicate (not the user's handle)."""
        if self.freed:
            return
        self.freed = True
        for wd in self._watchdogs.values():
            wd.stop()
        comms = [wd.comm for wd in self._watchdogs.values()]
        comms += [self._host] if self._host is not None else []
        if self._tier is not None:
            comms += [*self._tier.host, *self._tier.cross, *self._tier_base]
        comms += self._devices + [self.agreement, self.control, self.world]
        self._watchdogs, self._devices, self._host = {}, [], None
        self._tier, self._tier_base = None, ()
        for c in comms:
            try:
                c.Free()
            except Exception:  # noqa: BLE001 - MPI already finalized, or freed
                pass


def free_communicators(comm: Any = None) -> int:
    """Free the private communicators jaxsync made for ``comm`` (or for all).

    jaxsync duplicates each user communicator it is given (and once per local
    device, plus one per watchdog) and keeps the duplicates for the life of the
    process; they are freed at exit, before ``MPI_Finalize``. Call this to free
    them earlier, e.g. before freeing a communicator of your own. Collective:
    every process of ``comm`` must call it. Afterwards, transforms and compiled
    steps made with ``comm`` must not run again (make new ones: that duplicates
    afresh); finish pending steps first (``jax.block_until_ready``).

    Args:
      comm: an mpi4py communicator given to jaxsync, or ``None`` for all.

    Returns:
      How many user communicators were released.

    Example:
      >>> import jaxsync
      >>> jaxsync.free_communicators()  # nothing made in this process yet
      0
    """
    for hook in list(before_free):
        hook()
    if comm is None:
        victims = list(Comms._cache.values())
        Comms._cache.clear()
    else:
        c = Comms._cache.get(id(comm))
        victims = [c] if c is not None and c.user is comm else []
        if victims:
            del Comms._cache[id(comm)]
    if victims:
        _drain()
    for c in victims:
        c.free()
    return len(victims)


before_free: list = []
"""Callables run before jaxsync frees communicators (at exit, or by
:func:`free_communicators`): the timeline reads their names there."""


def _drain() -> None:
    """Let computations in flight finish their MPI calls.

    Waits until jaxsync's MPI calls and agreement callbacks have been quiet for a
    moment (``_quiet.wait_until_quiet``: a default synchronised step has no effect,
    which keeps jit's fast dispatch, so ``jax.effects_barrier`` does not see it),
    for steps with effects (a watchdog, host staging), and for every live array.
    """
    from . import _quiet

    _quiet.wait_until_quiet()
    try:
        jax.effects_barrier()
    except Exception:  # noqa: BLE001 - a failed step: its error was reported
        pass
    try:
        for a in jax.live_arrays():
            a.block_until_ready()
    except Exception:  # noqa: BLE001 - interpreter shutdown
        pass


@functools.cache
def _register_atexit() -> None:
    import atexit

    # Registered after mpi4py.MPI was imported (a Comms exists), so it runs
    # before mpi4py's MPI_Finalize: drain, stop the watchdogs, free.
    atexit.register(free_communicators)

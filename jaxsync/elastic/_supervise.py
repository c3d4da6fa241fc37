"""The supervisor's parts: capacity (hosts and slots), the launch, who was lost.

A training script run by ``python -m jaxsync elastic`` reads :func:`world` (which
restart this is, how many processes, the bounds) and calls it early: under the
supervisor it also records this process's pid and rank, so that a lost process
named by the launcher's report (MPICH's hydra names only a PID and a host) is
mapped to its rank and host. Capacity is a list of ``(host, slots)``: from
``--hosts`` (a lost process costs its slot on that host; on one machine "slots" are
processes) or from ``--host-discovery-script`` (Horovod's convention: the script
prints ``host:slots`` lines, and its answer after a failure is the new capacity).

Imports: the standard library only.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess

ENV_RESTART = "JAXSYNC_ELASTIC_RESTART"
ENV_NP = "JAXSYNC_ELASTIC_NP"
ENV_MIN_NP = "JAXSYNC_ELASTIC_MIN_NP"
ENV_MAX_NP = "JAXSYNC_ELASTIC_MAX_NP"
ENV_HOSTS = "JAXSYNC_ELASTIC_HOSTS"
ENV_DIR = "JAXSYNC_ELASTIC_DIR"  # where world() records pid -> rank


@dataclasses.dataclass(frozen=True)
class ElasticWorld:
    """What the supervisor told this process (``restart=0, np=None`` outside it).

    Attributes:
      restart: 0 for the first run, k for the k-th restart (resume from a checkpoint
        when > 0, or whenever one exists).
      np: the world size this run was started with.
      min_np, max_np: the supervisor's bounds.
      hosts: the capacity it launched on, ``host:slots`` joined by commas.
      supervised: whether ``python -m jaxsync elastic`` started this process.
    """

    restart: int = 0
    np: int | None = None
    min_np: int | None = None
    max_np: int | None = None
    hosts: str = ""
    supervised: bool = False


def _launcher_rank() -> int | None:
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return None


def world() -> ElasticWorld:
    """This process's elastic world, from the supervisor's environment variables.

    Under ``python -m jaxsync elastic`` it also records ``pid -> rank`` for the
    supervisor (a file in ``$JAXSYNC_ELASTIC_DIR``). Starts no MPI.

    Example:
      >>> import jaxsync.elastic as el
      >>> w = el.world()  # not under the supervisor here
      >>> (w.restart, w.np, w.supervised)
      (0, None, False)
    """
    env = os.environ
    if ENV_NP not in env:
        return ElasticWorld()
    folder, rank = env.get(ENV_DIR), _launcher_rank()
    if folder and rank is not None:
        try:
            with open(os.path.join(folder, f"pid-{os.getpid()}"), "w") as f:
                f.write(str(rank))
        except OSError:
            pass  # the supervisor then falls back on the report's host
    opt = lambda k: int(env[k]) if env.get(k, "").isdigit() else None  # noqa: E731
    return ElasticWorld(
        restart=int(env.get(ENV_RESTART, "0")),
        np=int(env[ENV_NP]),
        min_np=opt(ENV_MIN_NP),
        max_np=opt(ENV_MAX_NP),
        hosts=env.get(ENV_HOSTS, ""),
        supervised=True,
    )


def parse_hosts(text: str, what: str = "--hosts") -> list[tuple[str, int]]:
    """``host:slots`` items (commas, spaces or lines between them; slots default 1).

    Example:
      >>> from jaxsync.elastic._supervise import parse_hosts
      >>> parse_hosts("a:2, b\\nc:1")
      [('a', 2), ('b', 1), ('c', 1)]
    """
    out: list[tuple[str, int]] = []
    for item in re.split(r"[\s,]+", text.strip()):
        if not item:
            continue
        host, _, slots = item.partition(":")
        if not host or (slots and not slots.isdigit()):
            raise ValueError(
                f"{what}: expected host:slots items such as 'node1:4,node2:4', got {item!r}"
            )
        n = int(slots) if slots else 1
        if n > 0:
            out.append((host, n))
    return out


def discover(script: str, timeout: float = 60.0) -> list[tuple[str, int]]:
    """Run a host discovery script (Horovod's convention) and parse its lines."""
    try:
        out = subprocess.run(
            shlex.split(script), capture_output=True, text=True, timeout=timeout, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"--host-discovery-script {script!r} failed: {e}") from e
    return parse_hosts(out, what=f"--host-discovery-script {script!r}")


def placement(hosts: list[tuple[str, int]], np: int) -> list[tuple[str, int]]:
    """The first ``np`` slots, host by host (the launchers' default by-slot mapping).

    Example:
      >>> from jaxsync.elastic._supervise import placement
      >>> placement([("a", 2), ("b", 2)], 3)
      [('a', 2), ('b', 1)]
    """
    out, left = [], np
    for host, slots in hosts:
        if left <= 0:
            break
        take = min(slots, left)
        out.append((host, take))
        left -= take
    return out


def host_of_rank(placed: list[tuple[str, int]], rank: int) -> str | None:
    """The host that ``rank`` ran on under :func:`placement`'s mapping."""
    for host, slots in placed:
        if rank < slots:
            return host
        rank -= slots
    return None


_HYDRA = re.compile(r"=\s+(?:RANK\s+(\d+)\s+)?PID\s+(\d+)\s+RUNNING AT\s+(\S+)")
_OMPI = re.compile(  # Open MPI wraps the line at any space
    r"process\s+rank\s+(\d+)\s+with\s+PID\s+(\d+)\s+on\s+node\s+(\S+)\s+(?:exited|terminated)"
)


def lost_processes(output: str) -> list[tuple[int | None, int, str]]:
    """``(rank or None, pid, node)`` of each process the launcher reports as lost.

    Example:
      >>> from jaxsync.elastic._supervise import lost_processes
      >>> lost_processes("=   PID 13527 RUNNING AT vm\\n=   EXIT CODE: 9")
      [(None, 13527, 'vm')]
      >>> lost_processes("prterun noticed that process rank 1 with PID 77 on node\\nn2 "
      ...                "exited on signal 9 (Killed).")
      [(1, 77, 'n2')]
    """
    found: list[tuple[int | None, int, str]] = []
    for m in _HYDRA.finditer(output):
        found.append((int(m.group(1)) if m.group(1) else None, int(m.group(2)), m.group(3)))
    for m in _OMPI.finditer(output):
        found.append((int(m.group(1)), int(m.group(2)), m.group(3)))
    return found


def launcher_kind(mpirun: list[str]) -> str:
    """``"openmpi"`` or ``"mpich"`` (hydra), from ``mpirun --version``."""
    try:
        out = subprocess.run(
            [*mpirun, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "mpich"
    return "openmpi" if re.search(r"Open MPI|Open RTE|prte", out, re.I) else "mpich"


def mpirun_command(
    mpirun: list[str], kind: str, placed: list[tuple[str, int]], extra: list[str], cmd: list[str]
) -> list[str]:
    """The launch line for ``placed`` (no host flag when all on one host)."""
    np = sum(s for _, s in placed)
    line = [*mpirun, "-n", str(np)]
    if len({h for h, _ in placed}) > 1:
        spec = ",".join(f"{h}:{s}" for h, s in placed)
        line += ["--host", spec] if kind == "openmpi" else ["-hosts", spec]
    return [*line, *extra, *cmd]

"""The supervisor's parts: capacity (hosts and slots), the launch, who was lost.

A training script run by ``python -m jaxsync elastic`` reads :func:`world` (which
restart this is, how many processes, the bounds) and calls it early: under the
supervisor it also records this process's pid and rank, so that a lost process
named by the launcher's report (MPICH's hydra names only a PID and a host) is
mapped to its rank and host. Capacity is a list of ``(host, slots)``: from
``--hosts`` (a lost process costs its slot on that host; on one machine "slots" are
processes) or from ``--host-discovery-script`` (Horovod's convention: the script
prints ``host:slots`` lines, and its answer after a failure is the new capacity), or,
with ``--mpirun srun`` inside a Slurm allocation (``salloc``, ``sbatch``), from the
allocation's ``SLURM_JOB_NODELIST`` and ``SLURM_TASKS_PER_NODE``.

Imports: the standard library only.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
from collections.abc import Mapping

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


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list (``SLURM_JOB_NODELIST``) written out, in order.

    Example:
      >>> from jaxsync.elastic._supervise import expand_nodelist
      >>> expand_nodelist("n[1-3,07],gpu-a,x[09-10]")
      ['n1', 'n2', 'n3', 'n07', 'gpu-a', 'x09', 'x10']
    """
    out: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?", text.strip()):
        prefix, ranges = m.group(1), m.group(2)
        if ranges is None:
            out.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ValueError(
                    f"SLURM_JOB_NODELIST: expected a Slurm host list such as 'n[1-3],m', got "
                    f"{text!r} (item {part!r}); pass --hosts host:slots instead"
                )
            for i in range(int(lo), int(hi or lo) + 1):
                out.append(f"{prefix}{i:0{len(lo)}d}")
    return out


def expand_tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` (``2(x3),1``) as one count per node.

    Example:
      >>> from jaxsync.elastic._supervise import expand_tasks_per_node
      >>> expand_tasks_per_node("2(x3),1")
      [2, 2, 2, 1]
    """
    out: list[int] = []
    for item in text.strip().split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if m is None:
            raise ValueError(
                f"SLURM_TASKS_PER_NODE: expected counts such as '2(x3),1', got {text!r}; "
                "pass --hosts host:slots instead"
            )
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def slurm_allocation(
    env: Mapping[str, str] | None = None,
) -> list[tuple[str, int]] | None:
    """The ``(host, slots)`` of the Slurm allocation this runs in, or None outside one.

    Read from ``SLURM_JOB_NODELIST`` and ``SLURM_TASKS_PER_NODE`` (what ``salloc`` and
    ``sbatch`` set): the supervisor's capacity with ``--mpirun srun`` and no ``--hosts``.

    Example:
      >>> from jaxsync.elastic._supervise import slurm_allocation
      >>> slurm_allocation({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "4(x2)"})
      [('n1', 4), ('n2', 4)]
      >>> slurm_allocation({}) is None
      True
    """
    if env is None:
        env = os.environ
    nodes, tasks = env.get("SLURM_JOB_NODELIST"), env.get("SLURM_TASKS_PER_NODE")
    if not nodes or not tasks:
        return None
    hosts, counts = expand_nodelist(nodes), expand_tasks_per_node(tasks)
    if len(hosts) != len(counts):
        raise ValueError(
            f"SLURM_JOB_NODELIST={nodes!r} names {len(hosts)} node(s) but "
            f"SLURM_TASKS_PER_NODE={tasks!r} gives {len(counts)} count(s); expected one "
            "count per node. Pass --hosts host:slots instead"
        )
    return [(h, n) for h, n in zip(hosts, counts) if n > 0]


_HYDRA = re.compile(r"=\s+(?:RANK\s+(\d+)\s+)?PID\s+(\d+)\s+RUNNING AT\s+(\S+)")
_OMPI = re.compile(  # Open MPI wraps the line at any space
    r"process\s+rank\s+(\d+)\s+with\s+PID\s+(\d+)\s+on\s+node\s+(\S+)\s+(?:exited|terminated)"
)

# srun (Slurm): "srun: error: NODE: tasks 0-1,3: Killed" - killed by SIGKILL (the
# OOM killer, a kill -9, a node going away). "Terminated" is srun's own teardown of the
# other tasks (--kill-on-bad-exit), and an exit code is the script's own failure.
_SRUN = re.compile(r"srun: error: (\S+): tasks? ([\d,\-]+): Killed")
# srun, a node lost (its slurmd gone: powered off, cut off, crashed): "srun: error: Node
# failure on NODE" once Slurm declares it down (SlurmdTimeout); srun then kills the tasks
# on the other nodes ("NODE2: task 0: Killed"), which are not lost. The job survives it
# only when allocated with --no-kill (salloc/sbatch -k).
_NODE_FAILURE = re.compile(r"srun: error: Node failure on (\S+)")


# srun's pmi2 (Slurm 22.05) with MPICH's UCX netmod, tasks on several nodes: slurmstepd
# mangles the long addresses MPICH exchanges and MPI_Init fails (or hangs) now and then.
PMI2_MANGLED = "mpi/pmi2: value not properly terminated in client request"
PMI2_HINT = (
    "slurmstepd says 'mpi/pmi2: value not properly terminated': srun's pmi2 mangled "
    "MPICH's long UCX addresses and MPI failed to start (not a lost process). Fix: "
    "export MPIR_CVAR_CH4_NETMOD=ofi (and FI_PROVIDER=tcp on Ethernet) before the "
    "supervisor, or launch with srun --mpi=pmix where Slurm has PMIx"
)


def lost_nodes(output: str) -> list[str]:
    """The nodes the launcher reports lost whole (srun's "Node failure on NODE").

    Example:
      >>> from jaxsync.elastic._supervise import lost_nodes
      >>> lost_nodes("srun: error: Node failure on host1\\nsrun: error: host0: task 0: Killed")
      ['host1']
    """
    return list(dict.fromkeys(m.group(1) for m in _NODE_FAILURE.finditer(output)))


def _task_ids(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def lost_processes(output: str) -> list[tuple[int | None, int, str]]:
    """``(rank or None, pid, node)`` of each process the launcher reports as lost.

    ``pid`` is -1 where the launcher names none (srun names the task, its rank). A
    node lost whole (:func:`lost_nodes`) is one entry ``(None, -1, node)``; the tasks
    srun kills on the other nodes after it are not lost.

    Example:
      >>> from jaxsync.elastic._supervise import lost_processes
      >>> lost_processes("=   PID 13527 RUNNING AT vm\\n=   EXIT CODE: 9")
      [(None, 13527, 'vm')]
      >>> lost_processes("prterun noticed that process rank 1 with PID 77 on node\\nn2 "
      ...                "exited on signal 9 (Killed).")
      [(1, 77, 'n2')]
      >>> lost_processes("srun: error: node3: tasks 1-2,5: Killed\\n"
      ...                "srun: error: node3: task 0: Terminated")
      [(1, -1, 'node3'), (2, -1, 'node3'), (5, -1, 'node3')]
      >>> lost_processes("srun: error: Node failure on host1\\n"
      ...                "srun: error: host0: task 0: Killed")
      [(None, -1, 'host1')]
    """
    found: list[tuple[int | None, int, str]] = []
    for m in _HYDRA.finditer(output):
        found.append((int(m.group(1)) if m.group(1) else None, int(m.group(2)), m.group(3)))
    for m in _OMPI.finditer(output):
        found.append((int(m.group(1)), int(m.group(2)), m.group(3)))
    nodes = lost_nodes(output)
    found += [(None, -1, node) for node in nodes]
    for m in _SRUN.finditer(output):
        if not nodes or m.group(1) in nodes:  # after a node failure: srun's own kills
            found += [(task, -1, m.group(1)) for task in _task_ids(m.group(2))]
    return found


def launcher_kind(mpirun: list[str]) -> str:
    """``"openmpi"``, ``"slurm"`` (srun) or ``"mpich"`` (hydra), from ``--version``."""
    try:
        out = subprocess.run(
            [*mpirun, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "mpich"
    if re.match(r"\s*slurm", out, re.I):  # srun --version: "slurm 23.11.4", "slurm-wlm 22.05.8"
        return "slurm"
    return "openmpi" if re.search(r"Open MPI|Open RTE|prte", out, re.I) else "mpich"


def mpirun_command(
    mpirun: list[str], kind: str, placed: list[tuple[str, int]], extra: list[str], cmd: list[str]
) -> list[str]:
    """The launch line for ``placed`` (no host flag when all on one host).

    With srun (``kind="slurm"``): ``--kill-on-bad-exit=1`` (a lost task ends the step,
    so the others do not wait on it for ever), ``--mpi=pmi2`` unless ``extra`` names an
    ``--mpi``, and on several hosts the task layout as ``--nodelist`` with
    ``--distribution=arbitrary`` (one node name per task, in rank order).

    Example:
      >>> from jaxsync.elastic._supervise import mpirun_command
      >>> mpirun_command(["srun"], "slurm", [("n1", 2)], [], ["python", "t.py"])
      ['srun', '-n', '2', '--kill-on-bad-exit=1', '--mpi=pmi2', 'python', 't.py']
      >>> mpirun_command(["srun"], "slurm", [("n1", 2), ("n2", 1)], ["--mpi=pmix"], ["a"])[3:]
      ['--kill-on-bad-exit=1', '--nodelist=n1,n1,n2', '--distribution=arbitrary', '--mpi=pmix', 'a']
    """
    np = sum(s for _, s in placed)
    line = [*mpirun, "-n", str(np)]
    if kind == "slurm":
        line.append("--kill-on-bad-exit=1")
        if len({h for h, _ in placed}) > 1:
            layout = ",".join(h for h, s in placed for _ in range(s))
            line += [f"--nodelist={layout}", "--distribution=arbitrary"]
        if not any(a == "--mpi" or a.startswith("--mpi=") for a in extra):
            line.append("--mpi=pmi2")
        return [*line, *extra, *cmd]
    if len({h for h, _ in placed}) > 1:
        spec = ",".join(f"{h}:{s}" for h, s in placed)
        line += ["--host", spec] if kind == "openmpi" else ["-hosts", spec]
    return [*line, *extra, *cmd]

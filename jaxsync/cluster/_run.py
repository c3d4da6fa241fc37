"""Start an emulated cluster around one program and wait for it (the outer half).

The namespaces are made by ``unshare --user --map-root-user --net --mount --pid
--fork --kill-child``: a user namespace of one's own (no root needed where the
kernel allows unprivileged user namespaces), in which the supervisor
(``_inside``) is PID 1. Everything the cluster makes (bridge, veth pairs, host
namespaces, processes) lives in those namespaces; when the supervisor ends, for
whatever reason, the kernel kills every process in them and frees them, so a run
cannot leave anything behind, not even after ``kill -9`` of this process.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ._spec import LinkDown, Spec

UNSHARE = ["--user", "--map-root-user", "--net", "--mount", "--pid", "--fork"]


def unshare_flags(user_namespace: bool = True) -> list[str]:
    """``unshare``'s namespaces: a user namespace (root inside, nobody outside) unless
    ``user_namespace=False`` (the caller is root: daemons that call ``setgroups``,
    such as ``slurmctld``, need a real root)."""
    return UNSHARE if user_namespace else [f for f in UNSHARE if f not in _USER]


_USER = ("--user", "--map-root-user")


class ClusterUnavailable(RuntimeError):
    """This machine cannot run the emulated cluster; the message says what is missing."""


@dataclasses.dataclass(frozen=True)
class ClusterResult:
    """What :func:`run` returns.

    Attributes:
      returncode: the program's exit status (``mpirun``'s: non-zero when any rank
        failed); 124 when the time limit stopped it; 128+N after signal N.
      output: everything the ranks and the cluster printed, each rank's lines
        prefixed ``[hostH rR]``, the cluster's own ``[cluster]``.
      elapsed: seconds from start to end.
      timed_out: the time limit stopped the program.
    """

    returncode: int
    output: str
    elapsed: float
    timed_out: bool


def find_mpirun() -> str:
    """The hydra ``mpirun`` to use: ``$JAXSYNC_MPIRUN``, next to this Python, or on PATH."""
    for cand in (
        os.environ.get("JAXSYNC_MPIRUN"),
        str(Path(sys.executable).parent / "mpirun"),
        shutil.which("mpirun"),
    ):
        if cand and Path(cand).exists():
            return cand
    raise ClusterUnavailable(
        "jaxsync cluster: no mpirun found ($JAXSYNC_MPIRUN, next to "
        f"{sys.executable}, or on PATH). Fix: pip install 'jaxsync[mpi]' (the mpich "
        "wheel brings hydra's mpirun), or run scripts/setup.sh."
    )


@functools.cache
def _probe(user_namespace: bool = True) -> str | None:
    """Why the cluster cannot run here, or None. Cached: it runs a few commands."""
    if not user_namespace and os.geteuid() != 0:
        return (
            "user_namespace=False (--no-user-namespace) needs root: without a user "
            f"namespace the namespaces are made as this user (uid {os.geteuid()}). Fix: run "
            "as root, or leave the user namespace on (the default)."
        )
    if platform.system() != "Linux":
        return (
            f"the emulated cluster needs Linux network namespaces; this is "
            f"{platform.system()}. Fix: run it on Linux (a VM or container will do)."
        )
    missing = [t for t in ("unshare", "setpriv", "ip", "tc") if shutil.which(t) is None]
    if missing:
        return (
            f"missing {', '.join(missing)} on PATH. Fix: install util-linux (unshare, "
            "setpriv) and iproute2 (ip, tc), e.g. apt-get install util-linux iproute2."
        )
    try:
        mpirun = find_mpirun()
    except ClusterUnavailable as e:
        return str(e).removeprefix("jaxsync cluster: ")
    version = subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout
    if "HYDRA" not in version:
        return (
            f"{mpirun} is not MPICH's hydra launcher (the cluster starts each host "
            "through hydra's -launcher-exec). Fix: use the mpich wheel's mpirun "
            "(pip install mpich), or set $JAXSYNC_MPIRUN to a hydra mpirun."
        )
    script = (
        "ip link add jx0 type veth peer name jx1 && ip link set jx0 up && "
        "tc qdisc add dev jx0 root tbf rate 1gbit burst 131072 latency 100ms"
    )
    r = subprocess.run(
        ["unshare", *unshare_flags(user_namespace), "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if r.returncode != 0:
        why = r.stderr.strip().splitlines()[-1:] or ["no message"]
        if "unshare" in why[0]:
            return (
                f"cannot create a user and network namespace ({why[0]}). Fix: allow "
                "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 "
                "and user.max_user_namespaces > 0; on Ubuntu also "
                "kernel.apparmor_restrict_unprivileged_userns=0), or run as root."
            )
        return (
            f"a veth pair with a tbf shaper cannot be made in a namespace ({why[0]}). Fix: "
            "a kernel with veth and sch_tbf (modprobe veth sch_tbf)."
        )
    return None


def check(user_namespace: bool = True) -> None:
    """Raise :class:`ClusterUnavailable` if this machine cannot run the cluster.

    It needs Linux, ``unshare`` and ``setpriv`` (util-linux), ``ip`` and ``tc`` (iproute2), user
    and network namespaces (root, or unprivileged user namespaces), the veth and
    tbf kernel modules, and hydra's ``mpirun`` (the mpich wheel's).

    Raises:
      ClusterUnavailable: what is missing, and the fix.

    Example:
      >>> import jaxsync.cluster
      >>> jaxsync.cluster.check()  # nothing to say on this machine
    """
    why = _probe(bool(user_namespace))
    if why is not None:
        raise ClusterUnavailable(f"jaxsync cluster: {why}")


def run(
    command: Sequence[str],
    *,
    hosts: int = 2,
    procs_per_host: int = 1,
    link: str = "1gbit",
    devices: int | None = None,
    slow: dict[int, str] | None = None,
    link_down: Sequence[LinkDown] = (),
    timeout: float = 600.0,
    cwd: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    echo: Callable[[str], object] | None = None,
    launch: bool = True,
    user_namespace: bool = True,
) -> ClusterResult:
    """Run ``command`` on an emulated cluster of ``hosts`` hosts on one Linux machine.

    Each host is a network namespace on a bridge, its link shaped to ``link`` in
    each direction with ``tc tbf``; the program runs under hydra's ``mpirun``,
    ``procs_per_host`` ranks per host (ranks ``h*procs_per_host ...`` on host
    ``h``), MPI between hosts over TCP on the shaped links and between the
    processes of one host over shared memory, so ``jaxsync.topology()`` sees
    ``hosts`` hosts. The ranks also get ``$JAXSYNC_CLUSTER`` (the cluster as
    JSON), ``$JAXSYNC_CLUSTER_T0`` (the launch time, the clock of faults at a
    time) and ``$JAXSYNC_CLUSTER_MARKS`` (the folder :func:`mark` writes to, for
    faults that follow a marker), ``$JAXSYNC_CLUSTER_MPIRUN`` (a launcher: hydra's
    ``mpirun`` across the hosts, taking ``-hosts host0:2,...``) and
    ``$JAXSYNC_CLUSTER_HOSTFILE`` (``hostH:slots`` lines for the hosts alive: a
    lost host leaves it) and ``$JAXSYNC_CLUSTER_SSH`` (``SSH HOST COMMAND`` runs
    COMMAND on that host: e.g. Open MPI's ``plm_ssh_agent``), for a program that
    launches by itself (``launch=False``, e.g. ``python -m jaxsync elastic --mpirun
    "$JAXSYNC_CLUSTER_MPIRUN"``).
    Everything it made is gone when it returns, on success, failure, time-out
    or Ctrl-C.

    Args:
      command: the program, e.g. ``["python", "train.py"]`` (one rank per copy).
      hosts: number of hosts (network namespaces).
      procs_per_host: MPI processes on each host.
      link: each host's link rate in tc's words: ``"1gbit"``, ``"10gbit"``, ...
      devices: fake CPU devices per process (``--xla_force_host_platform_device_count``
        in ``XLA_FLAGS``); None leaves ``XLA_FLAGS`` as it is.
      slow: ``{host: rate}`` for hosts whose link is slower (or faster) than ``link``.
      link_down: faults: :class:`LinkDown` entries (a host's link down at a time
        after the launch or after a marker, for a while or for good). A fault
        whose marker never comes never fires; ``timeout`` still ends the run.
      timeout: seconds after which the program is stopped (exit status 124).
      cwd: the ranks' working directory (default: this one).
      env: the ranks' environment (default: this process's), to which the cluster
        adds its own variables.
      echo: called with each line of output as it comes (e.g. ``print``); the
        whole output is also in the result.
      launch: run ``command`` under ``mpirun`` across the hosts (one copy per
        rank); ``False``: once, outside the hosts, with the launcher above.
      user_namespace: make the namespaces inside a user namespace of their own
        (root inside it, nobody outside; the default, no root needed).
        ``False`` (root only): without one, for programs that need a real root
        inside, e.g. Slurm's daemons (``slurmctld`` calls ``setgroups``, which a
        user namespace refuses); the namespaces are still this run's own, and
        removed with it.

    Returns:
      A :class:`ClusterResult`.

    Raises:
      ClusterUnavailable: this machine cannot run it (what is missing, the fix).
      ValueError: a bad argument (named in the message).

    Example:
      >>> import sys, jaxsync.cluster
      >>> r = jaxsync.cluster.run(
      ...     [sys.executable, "-c", "import socket; print(socket.gethostname())"],
      ...     hosts=2, link="1gbit", timeout=60)
      >>> r.returncode, sorted(line for line in r.output.splitlines() if "] host" in line)
      (0, ['[host0 r0] host0', '[host1 r1] host1'])
    """
    if isinstance(command, str) or not command:
        raise ValueError(
            f"jaxsync.cluster.run: command must be a non-empty list of arguments, e.g. "
            f"['python', 'train.py'], got {command!r}."
        )
    if not timeout > 0:
        raise ValueError(f"jaxsync.cluster.run: timeout must be seconds > 0, got {timeout!r}.")
    spec = Spec(
        hosts=hosts,
        procs_per_host=procs_per_host,
        link=link,
        devices=devices,
        slow=tuple(sorted((slow or {}).items())),
        faults=tuple(link_down),
    )
    check(user_namespace)
    with tempfile.TemporaryDirectory(prefix="jaxsync-cluster-") as work:
        wd = Path(work)
        os.chmod(wd, 0o755)
        (wd / "spec.json").write_text(spec.to_json())
        job = dict(
            command=[str(c) for c in command],
            mpirun=find_mpirun(),
            timeout=float(timeout),
            cwd=str(Path(cwd or os.getcwd()).resolve()),
            launch=bool(launch),
        )
        (wd / "command.json").write_text(json.dumps(job))
        env = dict(os.environ if env is None else env)
        return _supervise(wd, timeout, env, echo, unshare_flags(user_namespace))


def _supervise(wd: Path, timeout: float, env: dict, echo, unshare: list[str]) -> ClusterResult:
    env.setdefault("PYTHONUNBUFFERED", "1")
    # The supervisor imports this very jaxsync; the ranks' environment is untouched.
    root = str(Path(__file__).resolve().parents[2])
    boot = (
        f"import sys; sys.path.insert(0, {root!r}); "
        "from jaxsync.cluster._inside import main; sys.exit(main(sys.argv[1:]))"
    )
    # setpriv: SIGKILL when this process (the thread that starts it) dies, however
    # it dies; unshare's --kill-child then takes PID 1 and the namespaces along.
    # (Not preexec_fn: that forks, and JAX warns that fork deadlocks its threads.)
    cmd = ["setpriv", "--pdeathsig", "KILL", "unshare", *unshare, "--mount-proc", "--kill-child"]
    cmd += [sys.executable, "-c", boot, str(wd)]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    lines: list[str] = []

    def pump():
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if echo is not None:
                echo(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        # The supervisor keeps the time limit itself; this is the backstop.
        proc.wait(timeout=timeout + 30)
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.kill()  # --kill-child: the supervisor and with it every namespace go
        proc.wait()
    except BaseException:  # Ctrl-C: let the supervisor stop the job, then make sure
        _stop(proc)
        raise
    reader.join(timeout=10)
    if proc.stdout is not None:
        proc.stdout.close()
    timed_out = timed_out or (wd / "timed_out").exists()
    return ClusterResult(
        returncode=124 if timed_out else proc.returncode,
        output="".join(lines),
        elapsed=time.monotonic() - t0,
        timed_out=timed_out,
    )


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the supervisor (it stops the job within its own 5 s grace and prints
    so); SIGKILL after 30 s, a backstop for a supervisor that cannot run at all."""
    for child in _children(proc.pid):
        try:
            os.kill(child, signal.SIGTERM)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()

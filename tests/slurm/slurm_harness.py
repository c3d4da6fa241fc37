"""A private Slurm for the tests: munged, slurmctld and slurmd under a temporary folder.

:class:`Slurm` writes a munge key and a ``slurm.conf`` (its own ports, state, spool and
log folders, ``SlurmUser=root``, ``ProctrackType=proctrack/linuxproc`` and
``TaskPlugin=task/none`` - no systemd or cgroups needed - ``MpiDefault=pmi2``), starts
``munged``, ``slurmctld`` and a ``slurmd`` per node (by default one, ``jaxsync0``, on this
machine; :class:`Node` for more), waits (bounded) until ``sinfo`` shows the nodes idle,
and stops every daemon it started on :meth:`Slurm.stop`. Its :meth:`Slurm.run` runs a
client command (``srun``, ``salloc``, ``python -m jaxsync elastic --mpirun srun``, ...)
with ``SLURM_CONF`` pointing at this cluster, in its own process group, killed whole past
its timeout.

Slurm's programs come from ``bash scripts/setup_slurm.sh`` (Debian's slurm-wlm and
munge). Without them the tests are skipped, naming that script, except in CI
(``CI`` set), where they fail. The daemons run as root (``SlurmUser=root``): where
this process is not root the tests are skipped the same way.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from _harness import Run, kill_group, requirement, run_in_group

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PYTHON = sys.executable
NODE = "jaxsync0"
CPUS = 4  # declared (SlurmdParameters=config_overrides): 2 ranks fit on a 2-core machine

PROGRAMS = (
    "munged",
    "mungekey",
    "slurmctld",
    "slurmd",
    "srun",
    "salloc",
    "sinfo",
    "scontrol",
    "scancel",
)


def _which(name: str) -> str | None:
    return shutil.which(name) or next(
        (str(p) for p in (Path("/usr/sbin") / name, Path("/sbin") / name) if p.exists()), None
    )


def missing() -> list[str]:
    """What the private Slurm needs and this machine lacks (empty: it can run)."""
    out = [p for p in PROGRAMS if _which(p) is None]
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        out.append("root (the daemons run with SlurmUser=root)")
    return out


_LACKS = missing()
MISSING = (
    f"needs Slurm and munge ({', '.join(_LACKS)} missing; install them: bash "
    "scripts/setup_slurm.sh)"
)

requires_slurm = requirement(bool(_LACKS), MISSING, "_slurm_required_in_ci")


@pytest.fixture
def _slurm_required_in_ci():
    pytest.fail(f"CI is set (scripts/test.sh installs it) but the test {MISSING}", pytrace=False)


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclasses.dataclass(frozen=True)
class Node:
    """One slurmd: its node name, the address slurmctld reaches it at, its hostname
    (None: this machine's) and ``launch``, which turns the slurmd command into the
    command that starts it there (e.g. into an emulated host's namespace)."""

    name: str = NODE
    addr: str = "127.0.0.1"
    hostname: str | None = None
    launch: Callable[[list[str]], list[str]] = list


class Slurm:
    """One private Slurm cluster (munged + slurmctld + a slurmd per node) in ``self.dir``.

    By default one node, ``jaxsync0``, on this machine; ``nodes`` (with ``controller``,
    the address slurmctld listens on, reachable from every node) makes more, e.g. one
    per host of ``python -m jaxsync cluster`` (worker_cluster.py).
    """

    def __init__(
        self,
        cpus: int = CPUS,
        nodes: Sequence[Node] = (Node(),),
        controller: str = "127.0.0.1",
        slurmd_timeout: int = 30,
    ) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="jaxsync-slurm-"))
        self.cpus = cpus
        self.nodes = tuple(nodes)
        self.controller = controller
        self.slurmd_timeout = slurmd_timeout
        self.conf = self.dir / "slurm.conf"
        self.munge_socket = self.dir / "munge" / "munge.socket.2"
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.logs: dict[str, Path] = {}

    # -- set-up ----------------------------------------------------------------
    def _write_conf(self) -> None:
        # FirstJobId: a fresh cluster would count its jobs from 1 again, and MPICH names
        # its shared memory after the PMI job id ("JOB.STEP"): a rank killed by a test
        # leaves its segment in /dev/shm, and a later cluster's job of the same id
        # attached to it and failed in MPI_Init ("Message ... truncated").
        ctld, slurmd = _free_ports(2)
        for d in ("state", "spool", "run"):
            (self.dir / d).mkdir(parents=True, exist_ok=True)
        host = socket.gethostname()
        d = self.dir
        self.logs["slurmctld"] = d / "log" / "slurmctld.log"
        for n in self.nodes:
            self.logs[f"slurmd {n.name}"] = d / "log" / f"slurmd-{n.name}.log"
            (d / "spool" / n.name).mkdir(parents=True, exist_ok=True)
        nodes = "\n".join(
            f"NodeName={n.name} NodeHostname={n.hostname or host} NodeAddr={n.addr} "
            f"CPUs={self.cpus} State=UNKNOWN"
            for n in self.nodes
        )
        names = ",".join(n.name for n in self.nodes)
        self.conf.write_text(
            f"""\
ClusterName=jaxsync
FirstJobId={random.randint(1_000_000, 60_000_000)}
SlurmctldHost={host}({self.controller})
SlurmctldPort={ctld}
SlurmdPort={slurmd}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd-%n.pid
SlurmctldLogFile={self.logs["slurmctld"]}
SlurmdLogFile={d}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=pmi2
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
PlugStackConfig={d}/plugstack.conf
ReturnToService=2
SlurmdTimeout={self.slurmd_timeout}
InactiveLimit=0
KillWait=5
MinJobAge=5
{nodes}
PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
        )
        (d / "plugstack.conf").write_text("")

    def _start(self, name: str, cmd: list[str]) -> None:
        log = self.dir / "log" / f"{name}.out"
        self.logs.setdefault(name, log)
        with open(log, "w") as f:
            proc = subprocess.Popen(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=self.env(),
            )
        self.procs.append((name, proc))

    def env(self, extra: dict | None = None) -> dict:
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        for k in list(env):  # a Slurm job around the test suite must not leak in
            if k.startswith(("SLURM_", "SRUN_", "SALLOC_", "SBATCH_")) and k != "SLURM_CONF":
                del env[k]
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
        env.update(extra or {})
        return env

    def start(self, timeout: float = 60.0) -> Slurm:
        """Start munged, slurmctld and slurmd; wait until the node is idle."""
        try:
            self._start_all(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_all(self, timeout: float) -> None:
        m = self.dir / "munge"
        m.mkdir()
        os.chmod(m, 0o711)  # munged wants its socket folder reachable by all
        (self.dir / "log").mkdir()
        key = m / "munge.key"
        subprocess.run(
            [_which("mungekey"), "--create", f"--keyfile={key}"],
            check=True,
            capture_output=True,
            timeout=30,
        )
        os.chmod(key, 0o600)
        self._start(
            "munged",
            [
                _which("munged"),
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={m}/munged.pid",
                f"--seed-file={m}/munged.seed",
                f"--log-file={m}/munged.log",
            ],
        )
        self._wait(lambda: self.munge_socket.exists(), 20, "munged's socket")
        self._write_conf()
        self._start("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._wait(self._ctld_up, timeout, "slurmctld answering `scontrol ping`")
        for n in self.nodes:
            slurmd = [_which("slurmd"), "-D", "-N", n.name, "-f", str(self.conf)]
            self._start(f"slurmd-{n.name}", n.launch(slurmd))
        names = ", ".join(n.name for n in self.nodes)
        self._wait(self._nodes_idle, timeout, f"sinfo showing node(s) {names} idle")

    def _client(self, cmd: list[str], timeout: float = 15.0) -> str:
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env())
        except subprocess.TimeoutExpired:
            return ""
        return p.stdout + p.stderr

    def _ctld_up(self) -> bool:
        return "is UP" in self._client(["scontrol", "ping"])

    def states(self) -> dict[str, str]:
        """Each node's state as sinfo says it (``idle``, ``alloc``, ``down*``, ...)."""
        lines = self._client(["sinfo", "-h", "-N", "-o", "%N %t"]).splitlines()
        return dict(line.split() for line in lines if len(line.split()) == 2)

    def _nodes_idle(self) -> bool:
        return self.states() == {n.name: "idle" for n in self.nodes}

    def _wait(self, ready, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name, proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"private Slurm: {name} exited with status {proc.returncode} while "
                        f"waiting for {what}.\n{self.tail()}"
                    )
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"private Slurm: no {what} after {timeout:.0f} s.\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        out = []
        for name, path in sorted(self.logs.items()):
            if path.exists():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"----- {name} ({path}) -----\n" + "\n".join(text))
        return "\n".join(out)

    # -- use ---------------------------------------------------------------------
    def run(self, cmd: list[str], timeout: float = 120.0, env: dict | None = None, cwd=None) -> Run:
        """Run a client command against this cluster; its whole group killed on timeout."""
        t0 = time.monotonic()
        rc, out, timed_out = run_in_group(cmd, timeout, self.env(env), cwd or ROOT, grace=0)
        self._client(["scancel", "--full", "-p", "debug"], timeout=10)  # nothing outlives a test
        return Run(cmd, rc, out, time.monotonic() - t0, timed_out)

    # -- tear-down ---------------------------------------------------------------
    def stop(self) -> None:
        """Stop every daemon started here (slurmd, slurmctld, munged) and remove the folder."""
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                kill_group(proc, grace=15)
                proc.wait(timeout=15)
        self.procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

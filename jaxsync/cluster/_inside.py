"""The cluster's supervisor: runs as PID 1 of the namespaces that ``_run`` creates.

``python -m jaxsync.cluster._inside DIR`` (``DIR/spec.json`` and ``DIR/command.json``
written by ``_run``), inside ``unshare --user --map-root-user --net --mount --pid`` (without
``--user --map-root-user`` where ``user_namespace=False``: a real root, for Slurm's daemons):

1. a tmpfs on ``/run/netns`` (this mount namespace's own, so ``ip netns`` names
   are invisible outside and vanish with it);
2. a bridge ``br0`` in this namespace (the switch), one network namespace per host
   with a veth pair to the bridge, each direction shaped with ``tc tbf`` (the
   host's uplink on its ``eth0``, its downlink on the switch port);
3. hydra's ``mpirun`` with an ssh stand-in (``DIR/ssh``) that runs each host's
   proxy in that host's namespace with a hostname of its own; MPI between hosts
   over UCX's TCP transport only (its shared-memory ones would bypass the links),
   between the processes of one host over MPICH's shared memory;
   or, with ``launch=False``, the program alone, which launches by itself with
   ``DIR/mpirun`` (that same launch) on ``DIR/hostfile`` (the hosts alive);
4. the faults on their timers (seconds after the launch, or after a marker that a
   rank writes into ``$JAXSYNC_CLUSTER_MARKS`` with ``jaxsync.cluster.mark``; a
   lost host's processes killed), the time limit, and at the end every process of
   the namespaces is killed (PID 1 may signal them all) and the network removed.

Nothing here is imported by jaxsync; it runs only inside those namespaces.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ._spec import MARKS_ENV, SUBNET, LinkDown, Spec, parse_rate, read_mark

BRIDGE = "br0"
ROOT = str(Path(__file__).resolve().parents[2])
TAG_BOOT = (
    f"import sys; sys.path.insert(0, {ROOT!r}); "
    "from jaxsync.cluster._tag import main; sys.exit(main(sys.argv[1:]))"
)


def log(msg: str) -> None:
    print(f"[cluster] {msg}", flush=True)


def sh(*cmd: str) -> None:
    """Run one network command; a failure stops the cluster with its message."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({r.returncode}): {r.stderr.strip()}")


def tbf(rate: str) -> list[str]:
    """``tc`` arguments of a token-bucket shaper at ``rate`` (bursts of ~2 ms)."""
    bps = parse_rate(rate)
    burst = max(128 * 1024, int(bps / 8 * 0.002))
    return ["tbf", "rate", f"{int(bps)}bit", "burst", str(burst), "latency", "100ms"]


def mount_netns_dir() -> None:
    run = Path("/run/netns")
    try:
        run.mkdir(parents=True, exist_ok=True)
        target = run
    except OSError:  # /run is not ours to write: a tmpfs over all of /run (this namespace only)
        sh("mount", "-t", "tmpfs", "jaxsync-cluster", "/run")
        run.mkdir(parents=True, exist_ok=True)
        target = None
    if target is not None:
        sh("mount", "-t", "tmpfs", "jaxsync-cluster", str(target))


def hosts_file(spec: Spec, work: Path) -> None:
    """``hostH`` resolves to host H's address inside the cluster (gloo, for one, looks
    its own hostname up): ``/etc/hosts`` plus the cluster's names, bound over it
    in this mount namespace only."""
    try:
        text = Path("/etc/hosts").read_text()
    except OSError:
        text = "127.0.0.1 localhost\n"
    names = "".join(f"{spec.address(h)} host{h}\n" for h in range(spec.hosts))
    path = work / "hosts"
    path.write_text(text.rstrip("\n") + "\n# jaxsync cluster\n" + names)
    sh("mount", "--bind", str(path), "/etc/hosts")


def build(spec: Spec, work: Path) -> None:
    mount_netns_dir()
    hosts_file(spec, work)
    sh("ip", "link", "set", "lo", "up")
    sh("ip", "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
    sh("ip", "link", "set", BRIDGE, "up")
    for h in range(spec.hosts):
        ns, port = f"host{h}", f"sw{h}"
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "link", "set", port, "master", BRIDGE, "up")
        sh("ip", "-n", ns, "addr", "add", f"{spec.address(h)}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        shaper = tbf(spec.rate(h))
        sh("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", *shaper)  # uplink
        sh("tc", "qdisc", "add", "dev", port, "root", *shaper)  # downlink


def teardown(spec: Spec) -> None:
    for h in range(spec.hosts):
        subprocess.run(["ip", "netns", "del", f"host{h}"], capture_output=True)
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)


def write_ssh(spec: Spec, path: Path) -> None:
    """``ssh [-x ...] HOST COMMAND`` into that host's namespace: hydra's ``-launcher-exec``."""
    cases = "\n".join(f"  {spec.address(h)}|host{h}) ns=host{h} ;;" for h in range(spec.hosts))
    path.write_text(
        "#!/bin/sh\n"
        "# ssh stand-in: run hydra's proxy inside the host's network namespace.\n"
        'while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done\n'
        'host="$1"; shift\n'
        'case "$host" in\n'
        f"{cases}\n"
        '  *) echo "jaxsync cluster: no host $host" >&2; exit 255 ;;\n'
        "esac\n"
        'export JAXSYNC_CLUSTER_HOST="${ns#host}"\n'
        "# a script (Open MPI's daemon: VAR=..;export VAR;..;prted) runs as one; a command execs\n"
        'case "$*" in *\\;*) run="$*" ;; *) run="exec $*" ;; esac\n'
        'exec ip netns exec "$ns" unshare --uts sh -c "hostname $ns && $run"\n'
    )
    path.chmod(0o755)


def write_launcher(spec: Spec, work: Path, mpirun: str, alive: set[int]) -> None:
    """For a program that launches by itself (``launch=False``, e.g. ``python -m jaxsync
    elastic``): ``DIR/mpirun``, hydra's ``mpirun`` across the hosts (``-hosts host0:2,...``
    or the hostfile's names), and ``DIR/hostfile``, ``hostH:slots`` for each host alive."""
    (work / "mpirun").write_text(
        f"#!/bin/sh\nexec {mpirun} -launcher ssh -launcher-exec {work / 'ssh'} -iface {BRIDGE}"
        ' "$@"\n'
    )
    (work / "mpirun").chmod(0o755)
    write_hostfile(spec, work, alive)


def write_hostfile(spec: Spec, work: Path, alive: set[int]) -> None:
    lines = "".join(f"host{h}:{spec.procs_per_host}\n" for h in sorted(alive))
    (work / "hostfile.tmp").write_text(lines)
    os.replace(work / "hostfile.tmp", work / "hostfile")  # whole: read at any moment


def rank_env(spec: Spec, t0: float, exits: Path, marks: Path) -> dict:
    env = dict(os.environ)
    env["JAXSYNC_CLUSTER_MPIRUN"] = str(exits.parent / "mpirun")
    env["JAXSYNC_CLUSTER_HOSTFILE"] = str(exits.parent / "hostfile")
    env["JAXSYNC_CLUSTER_SSH"] = str(exits.parent / "ssh")  # e.g. Open MPI's plm_ssh_agent
    env["JAXSYNC_CLUSTER_EXITS"] = str(exits)
    env[MARKS_ENV] = str(marks)
    env.setdefault("PYTHONUNBUFFERED", "1")  # lines reach the output as they are printed
    env["UCX_TLS"] = "tcp,self"
    env["UCX_NET_DEVICES"] = "eth0"
    if spec.devices is not None:
        flags = env.get("XLA_FLAGS", "")
        flags = " ".join(f for f in flags.split() if "force_host_platform_device_count" not in f)
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={spec.devices}".strip()
        env["JAXSYNC_CLUSTER_DEVICES"] = str(spec.devices)
    env["JAXSYNC_CLUSTER"] = spec.to_json()
    env["JAXSYNC_CLUSTER_T0"] = repr(t0)
    return env


def mpirun_cmd(spec: Spec, mpirun: str, ssh: Path, command: list[str]) -> list[str]:
    hosts = ",".join(f"{spec.address(h)}:{spec.procs_per_host}" for h in range(spec.hosts))
    return [
        mpirun,
        "-launcher",
        "ssh",
        "-launcher-exec",
        str(ssh),
        "-iface",
        BRIDGE,
        "-hosts",
        hosts,
        "-n",
        str(spec.size),
        sys.executable,
        "-c",
        TAG_BOOT,
        *command,
    ]


MARK_POLL_S = 0.05
"""How often a fault that waits for a marker looks for it (the marker's own time,
written by the rank, is what the fault counts from)."""


def fault_time(f: LinkDown, t0: float, marks: Path, stop: threading.Event) -> float | None:
    """When fault ``f`` is due (seconds since the epoch): ``at`` after the launch, or
    after the first :func:`~jaxsync.cluster.mark` of ``f.after``; None once ``stop``
    is set first (the run ended, e.g. a marker that never came)."""
    if f.after is None:
        return t0 + f.at
    while not stop.is_set():
        marked = read_mark(marks, f.after)
        if marked is not None:
            return marked[0] + f.at
        stop.wait(MARK_POLL_S)
    return None


def kill_host(host: int) -> int:
    """SIGKILL every process in ``host``'s network namespace; how many there were."""
    pids = subprocess.run(["ip", "netns", "pids", f"host{host}"], capture_output=True, text=True)
    for pid in pids.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    return len(pids.stdout.split())


def schedule_faults(
    spec: Spec, t0: float, marks: Path, stop: threading.Event, alive: set[int] | None = None
) -> list[threading.Thread]:
    lock = threading.Lock()
    work = marks.parent

    def one(f):
        port = f"sw{f.host}"
        due = fault_time(f, t0, marks, stop)
        if due is None or stop.wait(max(0.0, due - time.time())):
            return
        subprocess.run(["ip", "link", "set", port, "down"], capture_output=True)
        how = "for good" if f.duration is None else f"for {f.duration:g} s"
        since = "" if f.after is None else f" ({f.at:g} s after marker {f.after!r})"
        lost = ""
        if f.lost and alive is not None:  # the link first: the dead send nothing
            with lock:
                alive.discard(f.host)
                write_hostfile(spec, work, alive)
            lost = f"; host{f.host} lost: {kill_host(f.host)} process(es) killed"
        log(f"t={time.time() - t0:.2f} s: host{f.host}'s link down {how}{since}{lost}")
        if f.duration is None or stop.wait(f.duration):
            return
        subprocess.run(["ip", "link", "set", port, "up"], capture_output=True)
        if f.lost and alive is not None:
            with lock:
                alive.add(f.host)
                write_hostfile(spec, work, alive)
        log(f"t={time.time() - t0:.2f} s: host{f.host}'s link up")

    threads = [threading.Thread(target=one, args=(f,), daemon=True) for f in spec.faults]
    for t in threads:
        t.start()
    return threads


def unmarked(spec: Spec, marks: Path) -> list[str]:
    """What to say of each fault whose marker never came (it never fired)."""
    return [
        f"the fault on host{f.host}'s link after marker {f.after!r} never fired: no rank "
        f"called jaxsync.cluster.mark({f.after!r})"
        for f in spec.faults
        if f.after is not None and read_mark(marks, f.after) is None
    ]


FAILED_GRACE_S = 3.0
"""After a rank fails, how long mpirun has to end the job by itself."""
STOP_GRACE_S = 5.0
"""After a signal (Ctrl-C, SIGTERM), how long mpirun has to end the job; then SIGKILL."""


def failed_rank(exits: Path) -> tuple[str, int] | None:
    """A rank that failed: its program's status was non-zero, or its tagger is gone
    without one (killed: hydra kills a host's ranks on MPI_Abort)."""
    for pidfile in sorted(exits.glob("rank*.pid")):
        rank = pidfile.name.removesuffix(".pid")
        status = exits / f"{rank}.exit"
        if status.exists():
            text = status.read_text()
            if text and int(text) != 0:
                return rank, int(text)
            continue
        pid = pidfile.read_text().strip()
        if not pid.isdigit():  # being written (the tagger renames it into place)
            continue
        if not alive(int(pid)) and not status.exists():  # status written meanwhile?
            return rank, 137
    return None


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def wait(
    proc: subprocess.Popen, deadline: float, exits: Path, stopped: list[int] | None = None
) -> int | None:
    """mpirun's exit status, a failed rank's once the job is ended, or None at the deadline.

    Once a signal has stopped the job (``stopped``, filled by the handler, which
    sent mpirun's group SIGTERM), mpirun gets ``STOP_GRACE_S`` seconds to end;
    then every process is killed, so the stop never waits on a loaded machine's
    slow ranks (the outer process's grace is only a backstop)."""
    kill_at = None
    while time.time() < deadline:
        try:
            return proc.wait(timeout=0.25)
        except subprocess.TimeoutExpired:
            pass
        if stopped:
            kill_at = kill_at or time.time() + STOP_GRACE_S
            if time.time() >= kill_at:
                os.kill(-1, signal.SIGKILL)  # PID 1: every other process here
                return proc.wait()
            continue
        failed = failed_rank(exits)
        if failed:
            rank, rc = failed
            try:
                return proc.wait(timeout=FAILED_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            log(f"{rank} ended with status {rc} and mpirun did not end the job: ending it")
            end(proc)
            return rc
    return None


def end(proc: subprocess.Popen) -> None:
    """SIGTERM to mpirun and its group, SIGKILL to every process after 5 s."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.kill(-1, signal.SIGKILL)


def main(argv: list[str]) -> int:
    work = Path(argv[0])
    spec = Spec.from_json((work / "spec.json").read_text())
    job = json.loads((work / "command.json").read_text())
    proc: subprocess.Popen | None = None
    stopped: list[int] = []

    def on_signal(signum, frame):
        del frame
        stopped.append(signum)
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stop = threading.Event()
    marks: Path | None = None
    try:
        try:
            build(spec, work)
        except RuntimeError as e:
            log(f"could not build the emulated network: {e}")
            return 3
        ssh = work / "ssh"
        write_ssh(spec, ssh)
        rates = ", ".join(f"host{h} {spec.rate(h)}" for h in range(spec.hosts))
        log(
            f"{spec.hosts} hosts x {spec.procs_per_host} processes"
            + (f" x {spec.devices} devices" if spec.devices else "")
            + f"; links: {rates}; time limit {job['timeout']:g} s"
        )
        exits = work / "exits"
        exits.mkdir()
        marks = work / "marks"
        marks.mkdir()
        alive = set(range(spec.hosts))
        write_launcher(spec, work, job["mpirun"], alive)
        t0 = time.time()
        schedule_faults(spec, t0, marks, stop, alive)
        launch = job.get("launch", True)  # False: the program launches by itself
        proc = subprocess.Popen(
            mpirun_cmd(spec, job["mpirun"], ssh, job["command"]) if launch else job["command"],
            env=rank_env(spec, t0, exits, marks),
            cwd=job["cwd"],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        rc = wait(proc, t0 + job["timeout"], exits, stopped)
        if rc is None:
            log(f"time limit of {job['timeout']:g} s reached: stopping the job")
            (work / "timed_out").touch()
            end(proc)
            return 124
        if stopped:
            log(f"interrupted (signal {stopped[0]}): job stopped")
            return 128 + stopped[0]
        return rc
    finally:
        stop.set()
        for line in unmarked(spec, marks) if marks is not None else ():
            log(line)
        # PID 1 of this PID namespace: kill(-1) reaches every other process in it
        # (ranks, proxies, the launcher), so nothing outlives the cluster.
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        teardown(spec)
        sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

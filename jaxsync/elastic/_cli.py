"""``python -m jaxsync elastic``: run a job under mpirun, restart it on what is left.

``--mpirun srun`` launches with Slurm's srun instead (found by ``srun --version``):
inside an allocation (``salloc``, ``sbatch``) the capacity is the allocation's unless
``--hosts`` is given, each run is a job step, and a task srun reports ``Killed`` costs
its slot.

The loop: find the capacity (``--hosts`` or ``--host-discovery-script``), launch
``min(capacity, --max-np)`` processes (never fewer than ``--min-np``), pass the
launcher's output through while keeping it, and when the job fails take away the
lost processes' slots (or ask the discovery script again) and launch again, at most
``--max-restarts`` times. With a discovery script it is also asked during a run,
and a host of the run no longer listed ends the run (a host cut off from the
network can leave mpirun waiting for ever). The training script resumes from its
own last checkpoint (:func:`jaxsync.elastic.world` tells it which restart this is
and the world size).

Imports: the standard library and ``_supervise``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from . import _supervise as sv

_PREFIX = "[jaxsync elastic]"


def _say(msg: str) -> None:
    print(f"{_PREFIX} {msg}", file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxsync elastic",
        description="Run `mpirun -n N COMMAND` and, when the job fails (a process or host "
        "lost), restart it on the capacity left, from the training script's last "
        "checkpoint. The script reads jaxsync.elastic.world() (restart count, world size).",
        epilog="Example: python -m jaxsync elastic --min-np 2 --max-np 8 --hosts a:4,b:4 "
        "-- python train.py",
    )
    p.add_argument("--min-np", type=int, required=True, help="fewest processes to run on")
    p.add_argument("--max-np", type=int, required=True, help="most processes to run on")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--hosts",
        default=None,
        help="host:slots items, comma separated (default: localhost:MAX_NP); a lost "
        "process costs its slot",
    )
    where.add_argument(
        "--host-discovery-script",
        default=None,
        help="a command printing host:slots lines, asked before every launch",
    )
    p.add_argument(
        "--discovery-interval",
        type=float,
        default=2.0,
        help="seconds between asking the discovery script during a run; a host of the "
        "run that is no longer listed ends the run (a host cut off may hang it)",
    )
    p.add_argument("--max-restarts", type=int, default=3, help="restarts before giving up")
    p.add_argument(
        "--mpirun",
        default=None,
        help="the launcher (default: mpirun next to this Python, else on PATH); 'srun' "
        "runs each attempt as a Slurm job step (--mpi=pmi2, --kill-on-bad-exit=1; "
        "inside salloc/sbatch the allocation is the capacity unless --hosts is given)",
    )
    p.add_argument(
        "--mpirun-args",
        default="",
        help="more launcher options, one string (e.g. '--oversubscribe')",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    return p


def _check(args: argparse.Namespace, p: argparse.ArgumentParser) -> list[str]:
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("no command: give it after --, e.g. -- python train.py")
    if args.min_np < 1 or args.max_np < args.min_np:
        p.error(
            f"--min-np and --max-np: expected 1 <= min <= max, got {args.min_np} and "
            f"{args.max_np}; fix the bounds"
        )
    if not args.discovery_interval > 0:
        p.error(f"--discovery-interval: expected seconds > 0, got {args.discovery_interval}")
    if args.max_restarts < 0:
        p.error(f"--max-restarts: expected >= 0, got {args.max_restarts}")
    return cmd


def _mpirun(given: str | None) -> list[str]:
    if given:
        return shlex.split(given)
    here = Path(sys.executable).parent / "mpirun"
    found = str(here) if here.exists() else shutil.which("mpirun")
    if found is None:
        raise SystemExit(f"{_PREFIX} no mpirun next to {sys.executable} or on PATH; --mpirun")
    return [found]


def _launch(line: list[str], env: dict, watch=None, every=2.0) -> tuple[int, str, list[str]]:
    """Run the job; its output goes through to ours and is kept for the report.
    ``watch()``, called every ``every`` s, returns why to end the job (or None)."""
    kept: list[str] = []
    ended: list[str] = []
    with subprocess.Popen(
        line,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    ) as proc:
        done = threading.Event()
        if watch is not None:
            how = (proc, watch, every, done, ended)
            threading.Thread(target=_watch, args=how, daemon=True).start()
        try:
            assert proc.stdout is not None
            for text in proc.stdout:
                sys.stdout.write(text)
                sys.stdout.flush()
                kept.append(text)
            rc = proc.wait()
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            raise
        finally:
            done.set()
    return (128 - rc if rc < 0 else rc), "".join(kept), ended  # by a signal: 128 + it


def _watch(proc: subprocess.Popen, watch, every: float, done: threading.Event, ended) -> None:
    """End the job when ``watch()`` gives a reason: a host cut off from the network
    may leave mpirun and the ranks waiting for ever (hydra does), so the supervisor
    does not wait for them to notice. SIGTERM to the launcher's group, SIGKILL 5 s on."""
    while not done.wait(every):
        why = watch()
        if why is None:
            continue
        _say(f"{why}: ending the run")
        ended.append(why)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            if done.wait(5.0):
                return
        return


def _lost_slots(
    output: str, folder: Path, placed: list[tuple[str, int]]
) -> tuple[list[str], list[str], list[str]]:
    """The hosts whose processes were lost (one entry per process), the nodes lost
    whole (each takes all its slots), and what was seen."""
    pids = {}
    for f in folder.glob("pid-*"):
        try:
            pids[int(f.name[4:])] = int(f.read_text())
        except ValueError:
            continue
    hosts, seen = [], []
    names = {h for h, _ in placed}
    gone = sv.lost_nodes(output)
    for rank, pid, node in sv.lost_processes(output):
        if node in gone:  # a node lost whole: its slots go with it, not one by one
            seen.append(f"node {node} lost (node failure): every process on it")
            continue
        rank = pids.get(pid, rank)
        host = sv.host_of_rank(placed, rank) if rank is not None else None
        if host is None:
            host = node if node in names else (next(iter(names)) if len(names) == 1 else None)
        if host is not None:
            hosts.append(host)
            which = f"rank {rank if rank is not None else '?'}"
            seen.append(f"{which} (pid {pid}) on {host}" if pid >= 0 else f"{which} on {host}")
    return hosts, gone, seen


def run(args: argparse.Namespace, cmd: list[str]) -> int:
    """The supervisor's loop; returns the exit status (0: the job finished)."""
    mpirun = _mpirun(args.mpirun)
    kind = sv.launcher_kind(mpirun)
    extra = shlex.split(args.mpirun_args)
    alloc = sv.slurm_allocation() if kind == "slurm" and not args.hosts else None
    if args.hosts:
        static = sv.parse_hosts(args.hosts)
    elif alloc:
        static = alloc
        _say(f"capacity from the Slurm allocation: {_fmt(alloc)}")
    else:
        static = [("localhost", args.max_np)]
    restart, rc = 0, 0
    while True:
        hosts = sv.discover(args.host_discovery_script) if args.host_discovery_script else static
        capacity = sum(s for _, s in hosts)
        np = min(capacity, args.max_np)
        if np < args.min_np:
            _say(
                f"giving up: {capacity} slot(s) left ({_fmt(hosts)}), fewer than --min-np "
                f"{args.min_np}" + (f"; the last run's exit status was {rc}" if restart else "")
            )
            return rc or 1
        placed = sv.placement(hosts, np)
        with tempfile.TemporaryDirectory(prefix="jaxsync-elastic-") as tmp:
            env = dict(os.environ)
            env.update(
                {
                    sv.ENV_RESTART: str(restart),
                    sv.ENV_NP: str(np),
                    sv.ENV_MIN_NP: str(args.min_np),
                    sv.ENV_MAX_NP: str(args.max_np),
                    sv.ENV_HOSTS: _fmt(placed),
                    sv.ENV_DIR: tmp,
                }
            )
            line = sv.mpirun_command(mpirun, kind, placed, extra, cmd)
            _say(f"run {restart} on {np} process(es) ({_fmt(placed)}): {shlex.join(line)}")
            t0 = time.monotonic()
            script = args.host_discovery_script
            watch = _gone(script, placed) if script else None
            rc, output, ended = _launch(line, env, watch, args.discovery_interval)
            lost, gone, seen = _lost_slots(output, Path(tmp), placed)
        if rc == 0:
            _say(f"run {restart} finished ({time.monotonic() - t0:.1f} s)")
            return 0
        what = ", ".join(seen) if seen else "no lost process named in the launcher's output"
        if sv.PMI2_MANGLED in output:
            _say(sv.PMI2_HINT)
        what = f"ended by the supervisor ({ended[0]})" if ended else what
        took = time.monotonic() - t0
        _say(f"run {restart} failed with exit status {rc} after {took:.1f} s: {what}")
        if restart >= args.max_restarts:
            _say(f"giving up: --max-restarts {args.max_restarts} reached; exit status {rc}")
            return rc
        if not args.host_discovery_script:
            for host in lost:  # a lost process costs its slot (one machine: slots = processes)
                i = next((i for i, (h, s) in enumerate(static) if h == host and s > 0), None)
                if i is not None:
                    static[i] = (host, static[i][1] - 1)
            static = [(h, s) for h, s in static if s > 0 and h not in gone]
        restart += 1


def _gone(script: str, placed: list[tuple[str, int]]):
    """A watch: which hosts of ``placed`` the discovery script no longer lists."""

    def watch() -> str | None:
        try:
            listed = {h for h, _ in sv.discover(script)}
        except (RuntimeError, ValueError):
            return None  # a discovery that fails now and then ends nothing
        gone = sorted({h for h, _ in placed} - listed)
        return f"host(s) {', '.join(gone)} no longer discovered" if gone else None

    return watch


def _fmt(hosts: list[tuple[str, int]]) -> str:
    return ",".join(f"{h}:{s}" for h, s in hosts) or "none"


def main(argv: list[str]) -> int:
    p = _parser()
    args = p.parse_args(argv)
    cmd = _check(args, p)
    return run(args, cmd)

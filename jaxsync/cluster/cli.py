"""``python -m jaxsync cluster [options] -- PROGRAM ...``: the emulated cluster's command.

Example:
  >>> from jaxsync.cluster import cli
  >>> a = cli.parse(["--hosts", "2", "--procs-per-host", "2", "--link-down", "1@5+2",
  ...                "--", "python", "train.py"])
  >>> a.hosts, a.procs_per_host, a.link, a.link_down, a.command
  (2, 2, '1gbit', [LinkDown(host=1, at=5.0, duration=2.0)], ['python', 'train.py'])
  >>> cli.parse(["--link-down", "1@step-3+2", "--", "python", "train.py"]).link_down
  [LinkDown(host=1, at=0.0, duration=2.0, after='step-3')]
  >>> cli.parse(["--lose-host", "2@step-5", "--no-launch", "--", "sh", "x.sh"]).link_down
  [LinkDown(host=2, at=0.0, duration=None, after='step-5', lost=True)]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from ._run import ClusterUnavailable, run
from ._spec import LinkDown


def _slow(text: str) -> tuple[int, str]:
    host, sep, rate = text.partition("=")
    if not sep or not host.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST=RATE, e.g. 1=100mbit, got {text!r}")
    return int(host), rate.strip()


def _link_down(text: str) -> LinkDown:
    try:
        return LinkDown.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _lose_host(text: str) -> LinkDown:
    return dataclasses.replace(_link_down(text), lost=True)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jaxsync cluster",
        description="Run PROGRAM on an emulated cluster on this Linux machine: one network "
        "namespace per host on a bridge, each host's link shaped with tc tbf, the program "
        "under mpirun across the hosts (TCP between hosts, shared memory within one). "
        "Every namespace and link it makes is removed when the run ends. Exit status: "
        "the program's; 124 when --timeout stopped it.",
        epilog="Example: python -m jaxsync cluster --hosts 2 --procs-per-host 2 --link 1gbit "
        "--devices 2 -- python -m jaxsync selftest",
    )
    p.add_argument("--hosts", type=int, default=2, help="number of hosts (default 2)")
    p.add_argument(
        "--procs-per-host", type=int, default=1, help="MPI processes per host (default 1)"
    )
    p.add_argument(
        "--link",
        default="1gbit",
        help="each host's link rate, in tc's words: 1gbit, 10gbit, 100mbit (default 1gbit)",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="fake CPU devices per process (XLA_FLAGS); default: leave XLA_FLAGS alone",
    )
    p.add_argument(
        "--slow-host",
        type=_slow,
        action="append",
        default=[],
        metavar="HOST=RATE",
        help="give one host another link rate, e.g. 1=100mbit (repeatable)",
    )
    p.add_argument(
        "--link-down",
        type=_link_down,
        action="append",
        default=[],
        metavar="HOST@WHEN[+D]",
        help="fault: HOST's link goes down at WHEN for D seconds (without +D: for good); "
        "WHEN is T (seconds after the launch), MARKER (when a rank first calls "
        "jaxsync.cluster.mark(MARKER); a marker that never comes never fires) or MARKER:T "
        "(T seconds after it), e.g. 1@20+2, 1@step-3+2; repeatable",
    )
    p.add_argument(
        "--lose-host",
        type=_lose_host,
        action="append",
        dest="link_down",
        metavar="HOST@WHEN[+D]",
        help="fault: as --link-down, and every process of HOST is killed then (a lost "
        "host; it leaves $JAXSYNC_CLUSTER_HOSTFILE until its link comes back)",
    )
    p.add_argument(
        "--no-launch",
        dest="launch",
        action="store_false",
        help="run PROGRAM once, outside the hosts, instead of under mpirun: a program "
        "that launches by itself with $JAXSYNC_CLUSTER_MPIRUN on $JAXSYNC_CLUSTER_HOSTFILE "
        "(e.g. python -m jaxsync elastic)",
    )
    p.add_argument(
        "--no-user-namespace",
        dest="user_namespace",
        action="store_false",
        help="root only: make the namespaces without a user namespace of their own, for "
        "programs that need a real root inside (e.g. Slurm's daemons: slurmctld calls "
        "setgroups, which a user namespace refuses)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="stop the program after this many seconds (default 3600)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- PROGRAM [ARGS...]")
    args = p.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        p.error("no program given: put it after --, e.g. -- python train.py")
    return args


def main(argv: list[str] | None = None) -> int:
    """``python -m jaxsync cluster``; returns the program's exit status."""
    args = parse(list(sys.argv[1:] if argv is None else argv))
    import signal

    def on_term(signum, frame):  # SIGTERM (e.g. timeout(1), a scheduler): as Ctrl-C
        del frame
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        result = run(
            args.command,
            hosts=args.hosts,
            procs_per_host=args.procs_per_host,
            link=args.link,
            devices=args.devices,
            slow=dict(args.slow_host),
            link_down=args.link_down,
            timeout=args.timeout,
            echo=lambda line: print(line, flush=True),
            launch=args.launch,
            user_namespace=args.user_namespace,
        )
    except (ClusterUnavailable, ValueError) as e:
        print(e, file=sys.stderr)
        return 2
    return result.returncode

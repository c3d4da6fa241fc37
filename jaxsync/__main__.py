"""Command line: ``python -m jaxsync {demo,bench,tune,cluster,selftest,timeline,elastic,info}``."""

from __future__ import annotations

import argparse
import importlib
import sys

_HELP = {
    "demo": "data-parallel training under mpirun (2 processes x 2 fake CPU devices), "
    "compared with single-process training",
    "bench": "every strategy against the peers a user would write, side by side "
    "(table, JSON/CSV, PNG plot); run under mpirun for the inter-process part",
    "tune": "calibrate the cost model behind strategy='auto' (writes a JSON profile); "
    "--project prints predicted times for large clusters",
    "cluster": "run a program on an emulated multi-host cluster on this Linux machine "
    "(network namespaces, shaped links, faults)",
    "selftest": "check a new cluster before training: topology, every strategy exact, "
    "each tier's bandwidth (run under mpirun/srun or the cluster)",
    "timeline": "merge the ranks' timelines (jaxsync.timeline / JAXSYNC_TIMELINE=DIR) into "
    "one Chrome trace and draw a lane per rank and thread",
    "elastic": "run a job under mpirun and restart it on the processes or hosts left when "
    "one is lost, from the training script's last checkpoint (--min-np, --max-np)",
    "info": "versions, MPI library and thread level, and this process's topology "
    "(run alone or under mpirun)",
}

# the module whose ``main(argv)`` runs each command (relative to this package)
_MODULES = {
    "demo": ".bench.demo",
    "bench": ".bench.cli",
    "tune": ".auto._tune",
    "cluster": ".cluster.cli",
    "selftest": "._cli._selftest",
    "timeline": "._cli._timeline",
    "elastic": ".elastic._cli",
    "info": "._cli._info",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m jaxsync",
        description="jaxsync: gradient synchronisation for data-parallel JAX.",
        epilog="Run `python -m jaxsync COMMAND --help` for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, text in _HELP.items():
        sub.add_parser(name, help=text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command in _MODULES:  # imported only when run: each command's start-up stays its own
        return importlib.import_module(_MODULES[command], __package__).main(rest)
    parser.error(f"unknown command {command!r}; choose from {', '.join(_HELP)}")
    return 2


if __name__ == "__main__":
    sys.exit(main())

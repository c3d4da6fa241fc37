"""``python -m jaxsync info``: versions, MPI and topology of every process."""

from __future__ import annotations

import argparse
import json
import sys


def collect(comm="auto") -> dict:
    """Facts about this process: versions, MPI, topology. Collective over comm."""
    import jax
    import optax

    from . import __version__
    from ._topology import default_comm, topology

    if isinstance(comm, str) and comm == "auto":
        comm = default_comm()
    info = {"jaxsync": __version__, "jax": jax.__version__, "optax": optax.__version__}
    try:
        import mpi4py
        info["mpi4py"] = mpi4py.__version__
    except ImportError:
        info["mpi4py"] = None
    try:
        from . import _mpi
        import mpi4jax
        info["mpi4jax"] = mpi4jax.__version__
        try:
            _mpi._load()
            info["mpi_backend"] = "ok"
        except Exception as e:  # report, do not fail: info is a diagnostic
            info["mpi_backend"] = f"unavailable: {e}"
    except ImportError:
        info["mpi4jax"] = None
        info["mpi_backend"] = "unavailable: mpi4jax not installed"
    from . import _mpi as _native_mpi
    info["native_mpi"] = _native_mpi.native_status()
    if comm is not None or "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI
        info["mpi_library"] = MPI.Get_library_version().splitlines()[0].strip()
        levels = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                  MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
        info["mpi_thread_level"] = levels.get(MPI.Query_thread(), "?")
    info["devices"] = [str(d) for d in jax.local_devices()]
    info["topology"] = topology(comm).as_dict()
    return info


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxsync info",
        description="Print versions, the MPI library and thread level, and where each "
                    "process sits (rank, host, local devices). Run alone, or under "
                    "`mpirun -n P python -m jaxsync info` to see every rank.")
    p.add_argument("--json", action="store_true", help="one JSON object per rank")
    p.add_argument("--devices", type=int, default=None,
                   help="fake CPU devices per process (sets jax_num_cpu_devices)")
    args = p.parse_args(argv)
    if args.devices:
        import jax
        jax.config.update("jax_num_cpu_devices", args.devices)
    from ._topology import default_comm
    comm = default_comm()
    info = collect(comm)
    infos = comm.gather(info, root=0) if comm is not None else [info]
    if infos is None:
        return 0
    if args.json:
        for i in infos:
            print(json.dumps(i))
        return 0
    from rich.console import Console
    from rich.table import Table
    first = infos[0]
    con = Console()
    for key in ("jaxsync", "jax", "optax", "mpi4py", "mpi4jax", "mpi_backend",
                "mpi_library", "mpi_thread_level"):
        if key in first:
            con.print(f"{key:>17}: {first[key]}")
    t = Table(title="topology")
    for col in ("rank", "size", "host", "hosts", "local_rank", "local_size",
                "local_devices", "platform"):
        t.add_column(col, justify="right")
    for i in infos:
        topo = i["topology"]
        t.add_row(*(str(topo[c]) for c in ("rank", "size", "host", "hosts", "local_rank",
                                           "local_size", "local_devices", "platform")))
    con.print(t)
    return 0

"""``python -m jaxsync info``: versions, MPI and topology of every process."""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys


def collect(comm="auto") -> dict:
    """Facts about this process: versions, MPI, topology. Collective over comm."""
    import jax
    import optax

    from jaxsync import __version__
    from jaxsync._comm._topology import default_comm, topology

    if isinstance(comm, str) and comm == "auto":
        comm = default_comm()
    info = {"jaxsync": __version__, "jax": jax.__version__, "optax": optax.__version__}
    try:
        import mpi4py

        info["mpi4py"] = mpi4py.__version__
    except ImportError:
        info["mpi4py"] = None
    try:
        from importlib.metadata import PackageNotFoundError, version

        info["mpi4jax"] = version("mpi4jax")  # not imported: it would start MPI
    except PackageNotFoundError:
        info["mpi4jax"] = None
    info["mpi4jax_bridges"] = mpi4jax_bridges()
    from jaxsync._comm import _mpi_load

    native = _mpi_load.native_status()
    if native["built"]:
        native["links"] = linked_mpi(native["path"])
    info["native_mpi"] = native
    if jax.default_backend() == "cpu":
        info["mpi_backend"] = (
            "ok: jaxsync's native target" if native["loaded"] else f"unavailable: {native['error']}"
        )
    else:
        try:
            _mpi_load._load_mpi4jax()
            info["mpi_backend"] = "ok: mpi4jax's targets"
        except Exception as e:  # report, do not fail: info is a diagnostic
            info["mpi_backend"] = f"unavailable: {e}"
    if comm is not None or "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        info["mpi_library"] = MPI.Get_library_version().splitlines()[0].strip()
        levels = {
            MPI.THREAD_SINGLE: "single",
            MPI.THREAD_FUNNELED: "funneled",
            MPI.THREAD_SERIALIZED: "serialized",
            MPI.THREAD_MULTIPLE: "multiple",
        }
        info["mpi_thread_level"] = levels.get(MPI.Query_thread(), "?")
        from jaxsync.elastic import ulfm_status

        ft = ulfm_status()  # ULFM's MPIX_ symbols in the libmpi this process loaded
        info["ulfm"] = ("yes: " if ft["in_process_recovery"] else "no: ") + ft["why"]
    info["devices"] = [str(d) for d in jax.local_devices()]
    info["topology"] = topology(comm).as_dict()
    return info


def linked_mpi(path: str) -> str:
    """The MPI library a compiled bridge links, as the dynamic loader resolves it."""
    try:
        out = subprocess.run(["ldd", path], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({type(e).__name__})"
    return parse_ldd(out)


def parse_ldd(out: str) -> str:
    r"""The MPI line of ``ldd``'s output, as ``NAME => PATH``.

    Example:
      >>> from jaxsync._cli._info import parse_ldd
      >>> parse_ldd("\tlibmpi.so.12 => /v/lib/libmpi.so.12 (0x7f00)\n")
      'libmpi.so.12 => /v/lib/libmpi.so.12'
      >>> parse_ldd("\tlibmpi.so.12 => not found\n")  # doctest: +NORMALIZE_WHITESPACE
      'libmpi.so.12 => not found by ldd (no RUNPATH to it; at run time the MPI that
      mpi4py loaded first provides it)'
      >>> parse_ldd("\tlibc.so.6 => /lib/libc.so.6 (0x7f00)\n")
      'no MPI library linked'
    """
    for line in out.splitlines():
        name, _, target = line.strip().partition(" => ")
        if name.startswith(("libmpi.so", "libmpi_abi.so", "libmpich.so")):
            target = target.split(" (0x")[0].strip()
            if target == "not found":
                target = (
                    "not found by ldd (no RUNPATH to it; at run time the MPI that mpi4py "
                    "loaded first provides it)"
                )
            return f"{name} => {target}"
    return "no MPI library linked"


def mpi4jax_bridges() -> dict:
    """mpi4jax's compiled bridges (``cpu``, ``cuda``) and the MPI each one links.

    Found without importing mpi4jax (which would initialise MPI).
    """
    import importlib.util

    spec = importlib.util.find_spec("mpi4jax")
    if spec is None or spec.origin is None:
        return {}
    folder = pathlib.Path(spec.origin).parent / "_src" / "xla_bridge"
    out = {}
    for kind in ("cpu", "cuda"):
        found = sorted(folder.glob(f"mpi_xla_bridge_{kind}*.so"))
        if found:
            out[kind] = linked_mpi(str(found[0]))
    return out


# the topology table's columns, one row per rank
_COLUMNS = "rank size host hosts local_rank local_size local_devices platform".split()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxsync info",
        description="Print versions, the MPI library and thread level, and where each "
        "process sits (rank, host, local devices). Run alone, or under "
        "`mpirun -n P python -m jaxsync info` to see every rank.",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per rank")
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="fake CPU devices per process (sets jax_num_cpu_devices)",
    )
    p.add_argument(
        "--tree",
        default=None,
        help="also print what strategy='auto' chooses for this tree on this "
        "topology, with the predicted time of every strategy (a bench tree: "
        "resnet18, small500, transformer, mixed; or resnet50, transformer1b)",
    )
    p.add_argument(
        "--profile",
        default=None,
        help="with --tree: the profile (default: $JAXSYNC_PROFILE, else "
        "~/.cache/jaxsync/profile.json, else the built-in default)",
    )
    args = p.parse_args(argv)
    if args.devices:
        import jax

        jax.config.update("jax_num_cpu_devices", args.devices)
    from jaxsync._comm._topology import LaunchError, default_comm

    try:
        comm, launch_error = default_comm(), None
    except LaunchError as e:  # report it: info is the tool to diagnose a launch
        comm, launch_error = None, str(e)
        print(f"warning: {e}", file=sys.stderr)
    info = collect(comm)
    if launch_error:
        info["launch_error"] = launch_error
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
    for key in (
        "jaxsync",
        "jax",
        "optax",
        "mpi4py",
        "mpi4jax",
        "mpi_backend",
        "mpi_library",
        "mpi_thread_level",
        "ulfm",
    ):
        if key in first:
            con.print(f"{key:>19}: {first[key]}", soft_wrap=True)
    native = first.get("native_mpi") or {}
    if native.get("loaded"):
        text = f"built, links {native.get('links')}; built against {native.get('built_against')}"
    elif native.get("built"):
        text = f"built but NOT loadable: {native.get('error')}"
    else:
        text = f"NOT BUILT: {native.get('error')}"
    con.print(f"{'native MPI target':>19}: {text}", soft_wrap=True)
    bridges = first.get("mpi4jax_bridges") or {}
    for kind in ("cpu", "cuda"):
        state = ("built, links " + bridges[kind]) if kind in bridges else "not built"
        con.print(f"{'mpi4jax ' + kind.upper() + ' bridge':>19}: {state}", soft_wrap=True)
    from jaxsync import wire_formats

    wires = ", ".join(f"{f.name} ({f.bytes_per_value():.4g} B)" for f in wire_formats())
    con.print(f"{'wire formats':>19}: {wires}", soft_wrap=True)
    t = Table(title="topology")
    for col in _COLUMNS:
        t.add_column(col, justify="right")
    for i in infos:
        t.add_row(*(str(i["topology"][c]) for c in _COLUMNS))
    con.print(t)
    if args.tree:
        from jaxsync.auto._project import explain_tree

        con.print(
            explain_tree(args.tree, first["topology"], args.profile), soft_wrap=True, markup=False
        )
    return 0

"""Can the MPI that this process loaded recover in process (ULFM)?

The check is on the library itself, not its name: the ``libmpi`` mapped into this
process (``/proc/self/maps``) must export ULFM's ``MPIX_Comm_revoke``,
``MPIX_Comm_shrink`` and ``MPIX_Comm_agree``, and be Open MPI (MPICH exports the same
symbols, but its wheel's fault tolerance does not start: with
``MPIR_CVAR_ENABLE_FT=1`` every rank asserts in ``MPI_Init``). Whether this run has
fault tolerance switched on is a launch option (``mpirun --with-ft ulfm``), reported
from the environment Open MPI's launcher sets.

Imports: the standard library; mpi4py when called (it initialises MPI).
"""

from __future__ import annotations

import ctypes
import os

ULFM_SYMBOLS = ("MPIX_Comm_revoke", "MPIX_Comm_shrink", "MPIX_Comm_agree")
_MPI_LIB_NAMES = ("libmpi.so", "libmpich.so", "libmpi_abi.so")


def loaded_mpi_libraries(maps: str | None = None) -> list[str]:
    """Paths of the MPI libraries mapped into this process, in load order.

    Example:
      >>> from jaxsync.elastic._ulfm import loaded_mpi_libraries
      >>> loaded_mpi_libraries("7f00-7f01 r-xp 0 08:01 1 /v/lib/libmpi.so.40.40.1\\n"
      ...                      "7f01-7f02 r-xp 0 08:01 2 /lib/libc.so.6\\n")
      ['/v/lib/libmpi.so.40.40.1']
    """
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError:
            return []
    out: list[str] = []
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1] if len(line.split()) >= 6 else ""
        if os.path.basename(path).startswith(_MPI_LIB_NAMES) and path not in out:
            out.append(path)
    return out


def missing_symbols(path: str) -> list[str]:
    """ULFM's symbols that the library at ``path`` does not export."""
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        lib = ctypes.CDLL(path)
    return [s for s in ULFM_SYMBOLS if not hasattr(lib, s)]


def ulfm_status() -> dict:
    """Whether the loaded MPI can recover from a lost process without a restart.

    Returns a dict: ``library`` (MPI_Get_library_version's first line), ``path`` (the
    libmpi mapped in), ``missing`` (ULFM symbols it lacks), ``in_process_recovery``
    (bool), ``ft_launch`` (whether this run was launched with fault tolerance on;
    ``None`` outside a launcher) and ``why`` (a sentence). Imports mpi4py (MPI starts).
    """
    from mpi4py import MPI

    library = MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip()
    paths = loaded_mpi_libraries()
    path = paths[0] if paths else None
    missing = list(ULFM_SYMBOLS) if path is None else missing_symbols(path)
    is_ompi = "Open MPI" in library
    ok = is_ompi and not missing
    if ok:
        why = "Open MPI with ULFM: launch with `mpirun --with-ft ulfm` (not srun)"
    elif not is_ompi:
        why = (
            "not Open MPI: the mpich wheel's fault tolerance fails in MPI_Init; use the "
            "supervisor (python -m jaxsync elastic) or scripts/setup_ft.sh's environment"
        )
    else:
        why = f"this Open MPI lacks {', '.join(missing)} (built without ULFM)"
    ft_launch = None
    if "OMPI_COMM_WORLD_SIZE" in os.environ or "PMIX_RANK" in os.environ:
        ft_launch = os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() in ("1", "true")
    if ok and ft_launch:
        why = "Open MPI with ULFM, switched on in this run (mpirun --with-ft ulfm)"
    elif ok and ft_launch is False:
        why += "; this run was launched without it, so a lost process ends the job"
    return {
        "library": library,
        "path": path,
        "missing": missing,
        "in_process_recovery": ok,
        "ft_launch": ft_launch,
        "why": why,
    }

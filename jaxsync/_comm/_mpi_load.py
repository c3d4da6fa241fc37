"""Finding and loading MPI: mpi4py, mpi4jax, and jaxsync's own native library.

On CPU jaxsync calls MPI through XLA FFI targets of its own, compiled from
``jaxsync/_comm/_native/mpi_ffi.cc`` with the MPI compiler wrapper (``setup.py``) and
loaded here with ``ctypes`` (the primitive that binds them is in
``_native_prim``). This module checks versions and MPI's thread level, raises
the errors that name what is missing and the fix, reports the library's state
(``python -m jaxsync info``), and keeps the registry of texts that the native
calls agree on.

Imports: jax and ``_quiet`` (its exit drain is registered when MPI is loaded).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import sysconfig
from pathlib import Path

import jax

from . import _quiet

SUPPORTED_MPI4JAX = ("0.9",)
SUPPORTED_JAX = ("0.10", "0.11", "0.12")

_NATIVE_KINDS = (
    "allreduce",
    "allreduce_async",
    "allgather",
    "alltoall",
    "allgather_async",
    "alltoall_async",
    "agree",
    "step",
    "reduce",
    "bcast",
    "reduce_scatter",
)

NATIVE_DIR = Path(__file__).resolve().parent / "_native"
NATIVE_ENV = "JAXSYNC_NATIVE_LIB"  # a path that replaces the built library
_NATIVE_GLOB = "_jaxsync_mpi*.so"
_BUILD_FIX = (
    "Fix: build it with `bash scripts/setup.sh`, or "
    "`MPICC=$(which mpicc) pip install --no-build-isolation -e .` (or "
    "`python setup.py build_ext --inplace`) in the jaxsync checkout; "
    "`python -m jaxsync info` shows its state."
)


# Testing only: take the GPU path (mpi4jax's targets, ``_mpi4jax_prim``) on CPU
# too, through mpi4jax's CPU bridge, so CI checks what runs on GPUs.
MPI4JAX_ON_CPU_ENV = "JAXSYNC_TESTING_MPI4JAX"


def uses_mpi4jax() -> bool:
    """Whether a device-staged MPI stage calls mpi4jax's targets (every platform
    but CPU; on CPU too with ``JAXSYNC_TESTING_MPI4JAX=1``) rather than
    jaxsync's native ones."""
    return jax.default_backend() != "cpu" or os.environ.get(MPI4JAX_ON_CPU_ENV) == "1"


class MPIUnavailableError(ImportError):
    """mpi4py, a supported mpi4jax or jaxsync's native MPI library is missing."""


class NativeUnavailableError(MPIUnavailableError):
    """jaxsync's native MPI library (``jaxsync/_comm/_native``) is not built or not loadable."""


def native_path() -> Path:
    """The native library jaxsync loads (``$JAXSYNC_NATIVE_LIB`` overrides it)."""
    env = os.environ.get(NATIVE_ENV)
    if env:
        return Path(env)
    # One checkout may serve several environments (.venv, .venv-jax12: one build each,
    # named by the interpreter's suffix); this interpreter's own build comes first.
    own = NATIVE_DIR / f"_jaxsync_mpi{sysconfig.get_config_var('EXT_SUFFIX')}"
    if own.is_file():
        return own
    found = sorted(NATIVE_DIR.glob(_NATIVE_GLOB))
    return found[0] if found else NATIVE_DIR / "_jaxsync_mpi.<python ext suffix>.so"


# --------------------------------------------------------------------------
# Agreement inside the native calls.
#
# Each traced synchronisation registers the text it must agree on under a 63-bit id
# (from its SHA-256). Its native check (jaxsync_agree, agree.cc) carries
# (agreement communicator, id) as attributes and exchanges the id with a step
# count on every run (16 bytes; JAXSYNC_AGREE=once: the id, on the first run
# only). On a mismatch of ids every process calls back into Python (below), which
# exchanges the full texts and returns the message naming the difference.

_AGREEMENTS: dict = {}  # instance -> (mpi4py communicator, text, what, message builder)
_INSTANCES = itertools.count(1)


def register_agreement(comm, text: str, what: str, disagreement) -> tuple:
    """Register ``text`` for the in-call agreement: ``(comm handle, id, instance)``."""
    import hashlib

    ident = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1
    instance = next(_INSTANCES)  # one per traced synchronisation, on this process
    _AGREEMENTS[instance] = (comm, text, what, disagreement)
    return comm.py2f(), ident, instance


def _on_mismatch(instance, ident, out, cap):
    """Called by the native library on every process when the ids differ."""
    del ident
    try:
        comm, text, what, disagreement = _AGREEMENTS[instance]
        msg = disagreement(comm.allgather(text), what)
    except Exception as e:  # noqa: BLE001 - report instead of crashing the step
        msg = f"jaxsync: the processes disagree ({type(e).__name__}: {e})"
    data = msg.encode()[: cap - 1]
    ctypes.memmove(out, data, len(data))
    ctypes.memset(out + len(data), 0, 1)
    return len(data)


_MISMATCH_CB = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
)(_on_mismatch)


@functools.cache
def _native():
    """Load the native library once and register its FFI targets for CPU."""
    path = native_path()
    if not path.is_file():
        raise NativeUnavailableError(
            f"jaxsync's native MPI library is not built: looked for {path} "
            f"(pattern {NATIVE_DIR / _NATIVE_GLOB}"
            f"{', set by $' + NATIVE_ENV if os.environ.get(NATIVE_ENV) else ''}). "
            "jaxsync needs it for MPI communication on CPU and never falls back to "
            f"a slower path. {_BUILD_FIX}"
        )
    _load()  # libmpi comes from mpi4py first: the library must use the same MPI
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise NativeUnavailableError(
            f"jaxsync could not load its native MPI library {path}: {e}. It must be "
            f"built against the MPI that mpi4py uses. {_BUILD_FIX}"
        ) from e
    for kind in (*_NATIVE_KINDS, "tie"):
        name = f"jaxsync_{kind}"
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
    lib.jaxsync_mpi_header_version.restype = ctypes.c_char_p
    lib.jaxsync_set_mismatch_callback(_MISMATCH_CB)
    lib.jaxsync_calls_started.restype = ctypes.c_int64
    lib.jaxsync_calls_finished.restype = ctypes.c_int64
    lib.jaxsync_poll_yields.restype = ctypes.c_int64
    lib.jaxsync_poll_sleeps.restype = ctypes.c_int64
    _quiet.count_native_calls(lib)
    return lib


def native_loaded() -> bool:
    """Whether the native library is loaded (and its targets registered); never loads it."""
    return _native.cache_info().currsize > 0


def require_native() -> None:
    """Raise :class:`NativeUnavailableError` (naming the file and the fix) if missing."""
    _native()


def native_status() -> dict:
    """Where the native library is, whether it loads, and its MPI versions."""
    path = native_path()
    out = dict(
        path=str(path),
        built=path.is_file(),
        loaded=False,
        error=None,
        built_against=None,
        mpi_library=None,
    )
    if not out["built"]:
        out["error"] = f"not built. {_BUILD_FIX}"
        return out
    try:
        lib = _native()
    except Exception as e:  # reported, not raised: this is a status query
        out["error"] = str(e)
        return out
    out["loaded"] = True
    out["built_against"] = lib.jaxsync_mpi_header_version().decode()
    buf = ctypes.create_string_buffer(8192)
    if lib.jaxsync_mpi_library_version(buf, len(buf)) >= 0:
        out["mpi_library"] = buf.value.decode(errors="replace").strip().splitlines()[0]
    return out


def _check_version(part: str, package: str, version: str, supported, pin: str) -> None:
    """``package``'s major.minor ``version`` is one ``part`` supports, else
    MPIUnavailableError naming the versions and the pin to install."""
    if ".".join(version.split(".")[:2]) not in supported:
        raise MPIUnavailableError(
            f"jaxsync's {part} supports {package} {supported}; found {package} "
            f"{version}. Install a matching version (pip install '{pin}') or use "
            "comm=None / a mesh axis."
        )


@functools.cache
def _load():
    """Import mpi4py, check MPI's thread level, return the MPI module."""
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - depends on install
        raise MPIUnavailableError(
            "jaxsync needs mpi4py for inter-process communication (comm=...); "
            "install it with `pip install 'jaxsync[mpi]'`, or pass comm=None."
        ) from e
    _check_version("MPI backend", "jax", jax.__version__, SUPPORTED_JAX, "jax>=0.10,<0.13")
    import atexit

    # Registered after mpi4py's MPI_Finalize handler, so it runs before it:
    # computations still in flight finish their MPI calls first.
    atexit.register(_quiet._drain)
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError(
            "jaxsync needs MPI initialised with MPI_THREAD_MULTIPLE (each local "
            f"device runs in its own thread); MPI provides level {MPI.Query_thread()}. "
            "Do not set mpi4py.rc.thread_level to a lower level."
        )
    return MPI


@functools.cache
def _load_mpi4jax():
    """mpi4jax's FFI targets: the lowering on non-CPU platforms only."""
    MPI = _load()
    try:
        import mpi4jax  # noqa: F401  (registers the FFI targets)
        from mpi4jax._src.utils import to_dtype_handle, to_mpi_handle
    except ImportError as e:  # pragma: no cover - depends on install
        raise MPIUnavailableError(
            "on GPU jaxsync needs mpi4jax for inter-process communication "
            "(comm=...); install it with `pip install 'jaxsync[mpi]'`, or pass "
            "comm=None."
        ) from e
    _check_version(
        "GPU MPI path", "mpi4jax", mpi4jax.__version__, SUPPORTED_MPI4JAX, "mpi4jax==0.9.*"
    )
    return MPI, to_mpi_handle, to_dtype_handle

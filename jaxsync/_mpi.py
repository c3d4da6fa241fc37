"""Ordered MPI collectives that work inside multi-device computations.

On CPU jaxsync calls MPI through XLA FFI targets of its own, compiled from
``jaxsync/_native/mpi_ffi.cc`` with the MPI compiler wrapper (``setup.py``) and
loaded here with ``ctypes``:

* ``jaxsync_allreduce`` sums any number of buffers in one call, in place
  (results aliased to inputs, ``MPI_IN_PLACE``);
* ``jaxsync_allgather`` and ``jaxsync_alltoall`` move one buffer each.

Every call takes and returns an XLA token as a regular operand and result, the
communicator as an int32 operand (a Fortran handle, ``comm.py2f()``, so each
local device can use its own communicator without a ``lax.switch``) and an
``active`` int32 operand: 0 returns at once and leaves the buffers untouched
(the non-leader devices of a process, with no ``lax.cond`` and no copies). The
token is created inside the computation with ``lax.create_token()``, so no
effect escapes and multi-device ``shard_map`` and ``pmap`` accept it. One token
chain runs through every inter-process call of a traced step (see
:func:`chain_token`), so every process issues its calls in the same order.

On other platforms (``cuda``, untested here) the older primitive below binds
mpi4jax's FFI targets one buffer at a time.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import threading
import weakref
from pathlib import Path

import numpy as np

import jax
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax._src.interpreters import batching

from jax._src import core as _core
from jax._src import dispatch as _dispatch

SUPPORTED_MPI4JAX = ("0.9",)
SUPPORTED_JAX = ("0.10",)

_KINDS = ("allreduce", "allgather", "alltoall", "bcast")
_NATIVE_KINDS = ("allreduce", "allgather", "alltoall", "agree")

NATIVE_DIR = Path(__file__).resolve().parent / "_native"
NATIVE_ENV = "JAXSYNC_NATIVE_LIB"  # a path that replaces the built library
_NATIVE_GLOB = "_jaxsync_mpi*.so"
_BUILD_FIX = ("Fix: build it with `bash scripts/setup.sh`, or "
              "`MPICC=$(which mpicc) pip install --no-build-isolation -e .` (or "
              "`python setup.py build_ext --inplace`) in the jaxsync checkout; "
              "`python -m jaxsync info` shows its state.")


class MPIUnavailableError(ImportError):
    """mpi4py, a supported mpi4jax or jaxsync's native MPI library is missing."""


class NativeUnavailableError(MPIUnavailableError):
    """jaxsync's native MPI library (``jaxsync/_native``) is not built or not loadable."""


def native_path() -> Path:
    """The native library jaxsync loads (``$JAXSYNC_NATIVE_LIB`` overrides it)."""
    env = os.environ.get(NATIVE_ENV)
    if env:
        return Path(env)
    found = sorted(NATIVE_DIR.glob(_NATIVE_GLOB))
    return found[0] if found else NATIVE_DIR / "_jaxsync_mpi.<python ext suffix>.so"


# --------------------------------------------------------------------------
# Agreement inside the native calls.
#
# Each traced synchronisation registers the text it must agree on under a 63-bit id
# (from its SHA-256). Its native calls carry (agreement communicator, id) as
# attributes; the first call of a process with a given pair exchanges the ids
# over that communicator (8 bytes) and remembers the verdict, so later steps pay
# a table look-up, no host callback (which would put jit's dispatch on its slow
# path). On a mismatch every process calls back into Python (below), which
# exchanges the full texts and returns the message naming the first difference.

_AGREEMENTS: dict = {}   # instance -> (mpi4py communicator, text, what, message builder)
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


_MISMATCH_CB = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                ctypes.c_void_p, ctypes.c_int)(_on_mismatch)


@functools.lru_cache(maxsize=None)
def _native():
    """Load the native library once and register its FFI targets for CPU."""
    path = native_path()
    if not path.is_file():
        raise NativeUnavailableError(
            f"jaxsync's native MPI library is not built: looked for {path} "
            f"(pattern {NATIVE_DIR / _NATIVE_GLOB}"
            f"{', set by $' + NATIVE_ENV if os.environ.get(NATIVE_ENV) else ''}). "
            "jaxsync needs it for MPI communication on CPU and never falls back to "
            f"a slower path. {_BUILD_FIX}")
    _load()  # libmpi comes from mpi4py first: the library must use the same MPI
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise NativeUnavailableError(
            f"jaxsync could not load its native MPI library {path}: {e}. It must be "
            f"built against the MPI that mpi4py uses. {_BUILD_FIX}") from e
    for kind in _NATIVE_KINDS:
        name = f"jaxsync_{kind}"
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)),
                                    platform="cpu")
    lib.jaxsync_mpi_header_version.restype = ctypes.c_char_p
    lib.jaxsync_set_mismatch_callback(_MISMATCH_CB)
    lib.jaxsync_calls_started.restype = ctypes.c_int64
    lib.jaxsync_calls_finished.restype = ctypes.c_int64
    return lib


def require_native() -> None:
    """Raise :class:`NativeUnavailableError` (naming the file and the fix) if missing."""
    _native()


def native_status() -> dict:
    """Where the native library is, whether it loads, and its MPI versions."""
    path = native_path()
    out = dict(path=str(path), built=path.is_file(), loaded=False, error=None,
               built_against=None, mpi_library=None)
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


@functools.lru_cache(maxsize=None)
def _load():
    """Import mpi4py, check MPI's thread level, return the MPI module."""
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - depends on install
        raise MPIUnavailableError(
            "jaxsync needs mpi4py for inter-process communication (comm=...); "
            "install it with `pip install 'jaxsync[mpi]'`, or pass comm=None."
        ) from e
    jv = ".".join(jax.__version__.split(".")[:2])
    if jv not in SUPPORTED_JAX:
        raise MPIUnavailableError(
            f"jaxsync's MPI backend supports jax {SUPPORTED_JAX}; found jax "
            f"{jax.__version__}. Install a matching version (pip install "
            f"'jax==0.10.*') or use comm=None / a mesh axis.")
    import atexit
    # Registered after mpi4py's MPI_Finalize handler, so it runs before it:
    # computations still in flight finish their MPI calls first.
    atexit.register(_drain)
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError(
            "jaxsync needs MPI initialised with MPI_THREAD_MULTIPLE (each local "
            f"device runs in its own thread); MPI provides level {MPI.Query_thread()}. "
            "Do not set mpi4py.rc.thread_level to a lower level.")
    return MPI


@functools.lru_cache(maxsize=None)
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
            "comm=None.") from e
    mv = ".".join(mpi4jax.__version__.split(".")[:2])
    if mv not in SUPPORTED_MPI4JAX:
        raise MPIUnavailableError(
            f"jaxsync's GPU MPI path supports mpi4jax {SUPPORTED_MPI4JAX}; found "
            f"{mpi4jax.__version__}. Install a matching version (pip install "
            "'mpi4jax==0.9.*') or use comm=None / a mesh axis.")
    return MPI, to_mpi_handle, to_dtype_handle


def _drain():
    wait_until_quiet()
    try:
        for a in jax.live_arrays():
            a.block_until_ready()
    except Exception:  # pragma: no cover - interpreter shutdown
        pass


def wait_until_quiet(quiet_s: float = 0.25, limit_s: float = 10.0) -> bool:
    """Wait until no synchronised step is running (before MPI and Python shut down).

    A step dispatched and dropped (its results gone, so no live array to block
    on) still runs its MPI calls and its agreement callback. A default step has
    no effect that ``jax.effects_barrier`` could wait for (an effect would slow
    every dispatch), so this watches jaxsync's own activity instead: no native
    MPI call running, and none, nor any agreement callback, begun or ended for
    ``quiet_s`` seconds (chained steps start as their inputs become ready).
    Gives up after ``limit_s`` (a peer that never arrives). True when quiet.
    """
    import time
    from . import _agree
    lib = _native() if _native.cache_info().currsize else None

    def state():
        calls = ((lib.jaxsync_calls_started(), lib.jaxsync_calls_finished())
                 if lib is not None else (0, 0))
        return (*calls, *_agree.ACTIVITY)

    start = now = time.monotonic()
    last, since = state(), start
    if last == _QUIET[0]:  # nothing ran since the last quiet wait (several exit hooks)
        return True
    while now - start < limit_s:
        time.sleep(0.01)
        now = time.monotonic()
        cur = state()
        if cur != last or cur[0] != cur[1] or cur[2] != cur[3]:
            last, since = cur, now
        elif now - since >= quiet_s:
            _QUIET[0] = cur
            return True
    return False


_QUIET: list = [None]  # jaxsync's activity counters at the last quiet wait


# --------------------------------------------------------------------------
# One token chain per traced computation.
#
# Each inter-process call consumes the token of the previous call in the same
# traced computation, so two synchronisations in one step (or the buckets of
# one) run in the same order on every process. The latest token of each trace
# is kept per thread in a WeakKeyDictionary keyed by the trace; entries of
# traces that are no longer on the current trace's ancestor chain (finished
# traces: tracing is a stack within a thread) are dropped on each access, so
# at most the last traced step's chain stays referenced until the next trace.

_chains = threading.local()


def _owner():
    """The trace that owns tokens made here (vmap's traces pass values up)."""
    trace = _core.trace_ctx.trace
    while isinstance(trace, batching.BatchTrace):
        trace = trace.parent_trace
    return trace


def _ancestors(trace):
    seen = []
    while trace is not None:
        seen.append(trace)
        trace = getattr(trace, "parent_trace", None)
    return seen


def _table(trace) -> weakref.WeakKeyDictionary:
    table = getattr(_chains, "table", None)
    if table is None:
        table = _chains.table = weakref.WeakKeyDictionary()
    live = _ancestors(trace)
    for t in list(table.keys()):
        if not any(t is a for a in live):
            del table[t]
    return table


def chain_value(key: str, first):
    """The latest value of chain ``key`` in the current traced computation.

    ``first()`` makes the value the chain starts from. Eagerly (no trace) the
    chain is one concrete value per thread (a token or a byte, nothing traced).
    """
    trace = _owner()
    if isinstance(trace, _core.EvalTrace):
        value = getattr(_chains, "eager", {}).get(key)
        return first() if value is None else value
    value = _table(trace).get(trace, {}).get(key)
    return first() if value is None else value


def set_chain_value(key: str, value) -> None:
    """Record ``value`` as the latest of chain ``key`` in the current trace."""
    trace = _owner()
    if isinstance(trace, _core.EvalTrace):
        if not hasattr(_chains, "eager"):
            _chains.eager = {}
        _chains.eager[key] = value
    else:
        _table(trace).setdefault(trace, {})[key] = value


def chain_token():
    """The latest MPI token of the current traced computation (a new one at first)."""
    return chain_value("token", lax.create_token)


def set_chain_token(token) -> None:
    set_chain_value("token", token)


# --------------------------------------------------------------------------
# The native primitive: (token, comm, active, *xs) -> (token, *ys).

native_p = Primitive("jaxsync_native")
native_p.multiple_results = True


def _drop_varying(aval, axes):
    """``aval`` typed invariant over ``axes`` (shard_map axes of size 1)."""
    mat = getattr(aval, "manual_axis_type", None)
    if not axes or mat is None or not (mat.varying & set(axes)):
        return aval
    return aval.update(manual_axis_type=_core.ManualAxisType(
        varying=mat.varying - set(axes), unreduced=mat.unreduced, reduced=mat.reduced))


def _native_abstract_eval(token, comm, active, *xs, kind, size, invariant, agree, group):
    del agree, group
    del token, comm, active
    outs = []
    for x in xs:
        if kind == "allgather":
            spec = x.sharding.spec
            sharding = x.sharding.update(spec=type(spec)(None, *spec))
            out = x.update(shape=(size, *x.shape), sharding=sharding)
        else:
            out = x.update(shape=x.shape)
        outs.append(out if kind == "alltoall" else _drop_varying(out, invariant))
    return (_core.abstract_token, *outs)


native_p.def_abstract_eval(_native_abstract_eval)
native_p.def_impl(functools.partial(_dispatch.apply_primitive, native_p))


def _native_lowering(ctx, token, comm, active, *xs, kind, size, invariant, agree, group):
    del size, invariant
    if kind == "allreduce":  # in place: result i is operand 3 + i
        aliases = {3 + i: 1 + i for i in range(len(xs))}
    else:
        aliases = None
    rule = jax.ffi.ffi_lowering(f"jaxsync_{kind}", operand_output_aliases=aliases)
    if kind == "allreduce":
        return rule(ctx, token, comm, active, *xs, group_bytes=np.int64(group))
    if kind != "agree":
        return rule(ctx, token, comm, active, *xs)
    return rule(ctx, token, comm, active, *xs, agree_comm=np.int64(agree[0]),
                agree_id=np.int64(agree[1]), agree_instance=np.int64(agree[2]),
                agree_devices=np.int64(agree[3]))


mlir.register_lowering(native_p, _native_lowering, platform="cpu")


def _native_batching(args, dims, *, kind, size, invariant, agree, group):
    # Under vmap every mapped replica takes part as a slice of one larger message.
    token, comm, active, *xs = args
    nm = None  # not mapped
    if any(d is not nm for d in dims[:3]):
        raise NotImplementedError(
            "jaxsync: the communicator and the active flag of an MPI call cannot "
            "be batched (vmap them outside the synchronisation)")
    xdims = dims[3:]
    if kind == "alltoall":  # the leading (peer) axis must stay first
        xs = [x if d is nm else jax.numpy.moveaxis(x, d, 1) for x, d in zip(xs, xdims)]
        xdims = [d if d is nm else 1 for d in xdims]
    outs = native_p.bind(token, comm, active, *xs, kind=kind, size=size,
                         invariant=invariant, agree=agree, group=group)
    if kind == "allgather":
        xdims = [d if d is nm else d + 1 for d in xdims]
    return outs, (nm, *xdims)


batching.primitive_batchers[native_p] = _native_batching


GROUP_BYTES = 64 * 2**10
"""Default of ``native_call``'s ``group``: buffers under it are summed together."""


def native_call(kind, xs, token, comm, active, size, invariant=(), agree=(0, 0, 1),
                group=GROUP_BYTES):
    """Bind one native collective: returns ``(token, [results])``.

    Args:
      kind: ``"allreduce"`` (sum of every buffer of ``xs``, in place),
        ``"allgather"`` (one buffer; stacks along a new leading axis of size
        ``size``) or ``"alltoall"`` (one buffer whose leading axis has size
        ``size``).
      xs: the local arrays.
      token: the previous call's token (see :func:`chain_token`).
      comm: int32 scalar: the communicator's Fortran handle (``comm.py2f()``).
      active: int32 scalar: 0 returns the inputs untouched (allreduce) or zeros.
      size: the communicator's size.
      invariant: shard_map axes of size 1 over which the results are typed
        invariant (allreduce, allgather): the sum over one member is that
        member's value, so no collective over them is needed for the type.
      agree: for ``kind="agree"``, ``(communicator handle, digest id, instance,
        devices of this process that run the check)`` (see
        :func:`register_agreement`).
      group: for ``kind="allreduce"``, buffers (of one dtype, in order) under
        this many bytes are copied into one scratch buffer of at most
        ``max(group, 4 MiB)`` bytes and summed by one MPI call (``flat`` passes
        its ``bucket_bytes``: one message per bucket, packed by the target).
    """
    assert kind in _NATIVE_KINDS, kind
    require_native()
    token, *ys = native_p.bind(token, comm, active, *xs, kind=kind, size=int(size),
                               invariant=tuple(invariant),
                               agree=tuple(int(a) for a in agree), group=int(group))
    return token, ys


# --------------------------------------------------------------------------
# mpi4jax's targets: the lowering on non-CPU platforms (untested here).


class _Hashable:
    """Wrap an MPI communicator so it can be a primitive parameter."""

    def __init__(self, comm):
        self.comm = comm

    def __hash__(self):
        return id(self.comm)

    def __eq__(self, other):
        return isinstance(other, _Hashable) and other.comm is self.comm

    def __repr__(self):
        return f"Comm(size={self.comm.Get_size()})"


mpi_p = Primitive("jaxsync_mpi")
mpi_p.multiple_results = True


def _abstract_eval(x, token, *, kind, comm, root):
    del token, root
    size = comm.comm.Get_size()
    shape = (size, *x.shape) if kind == "allgather" else x.shape
    # Keep shard_map's manual-axis types of the input (a per-device value).
    if kind == "allgather":
        spec = x.sharding.spec
        sharding = x.sharding.update(spec=type(spec)(None, *spec))
        out = x.update(shape=shape, sharding=sharding)
    else:
        out = x.update(shape=shape)
    return (out, _core.abstract_token)


mpi_p.def_abstract_eval(_abstract_eval)
mpi_p.def_impl(functools.partial(_dispatch.apply_primitive, mpi_p))


def _lowering(ctx, x, token, *, kind, comm, root):
    MPI, to_mpi_handle, to_dtype_handle = _load_mpi4jax()
    x_aval = ctx.avals_in[0]
    n = np.int64(np.prod(x_aval.shape, dtype=np.int64))
    dtype = np.int64(to_dtype_handle(x_aval.dtype))
    c = np.int64(to_mpi_handle(comm.comm))
    if kind == "allreduce":
        attrs = dict(nitems=n, op=np.int64(to_mpi_handle(MPI.SUM)), comm=c, dtype=dtype)
    elif kind == "allgather":
        attrs = dict(sendcount=n, sendtype=dtype, recvcount=n, recvtype=dtype, comm=c)
    elif kind == "alltoall":
        per = np.int64(n // comm.comm.Get_size())
        attrs = dict(sendcount=per, sendtype=dtype, recvcount=per, recvtype=dtype, comm=c)
    elif kind == "bcast":
        attrs = dict(nitems=n, root=np.int64(root), comm=c, dtype=dtype)
    else:  # pragma: no cover
        raise ValueError(kind)
    rule = jax.ffi.ffi_lowering(f"mpi_{kind}_ffi", has_side_effect=True)
    return rule(ctx, x, token, **attrs)


mlir.register_lowering(mpi_p, _lowering, platform="cuda")


def _batching(args, dims, **params):
    x, token = args
    xd, _ = dims
    nm = None  # not mapped
    if xd is nm:
        return mpi_p.bind(x, token, **params), (nm, nm)
    kind = params["kind"]
    if kind == "alltoall":  # the leading (peer) axis must stay first
        x = jax.numpy.moveaxis(x, xd, 1)
        y, tok = mpi_p.bind(x, token, **params)
        return (y, tok), (1, nm)
    y, tok = mpi_p.bind(x, token, **params)
    return (y, tok), (xd + 1 if kind == "allgather" else xd, nm)


batching.primitive_batchers[mpi_p] = _batching


def call(kind, x, token, comm, root=0):
    """Bind one tokened mpi4jax collective (non-CPU platforms): ``(result, token)``."""
    assert kind in _KINDS, kind
    _load_mpi4jax()
    return mpi_p.bind(x, token, kind=kind, comm=_Hashable(comm), root=int(root))

"""Collectives: XLA mesh axes inside a process, MPI or a mesh axis across them.

Everything here runs inside a mapped context (``shard_map``, ``pmap`` or
``vmap(axis_name=...)``), or under plain ``jit`` when a process has a single
device and no intra axes. Strategies see only two kinds of objects:

* :class:`AxisOps` - sum / all-to-all / all-gather over XLA axes;
* a backend - ``run(program, bufs, intra, leader_only)`` runs ``program(ops,
  bufs)`` with ``ops`` reducing *across processes* (over MPI with a token that
  fixes the order of every call, over a mesh axis, or not at all).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import io_callback
from jax._src import core as _core
from jax._src.interpreters import batching as _batching

from . import _mpi
from ._topology import Comms

Axes = tuple

try:  # typed as replicated over the axes (shard_map check_vma); jax >= 0.7
    from jax._src.lax.parallel import all_gather_invariant as _all_gather_invariant
except ImportError:  # pragma: no cover
    _all_gather_invariant = None


def _is_batched(x) -> bool:
    return isinstance(x, _batching.BatchTracer)


def bound_axes() -> dict:
    """The axis names bound where this is traced, with their sizes."""
    return dict(_core.get_axis_env().axis_sizes)


def check_axes(axes: Axes, what: str = "axis_name") -> None:
    """Raise a NameError at trace time when an axis is not bound."""
    bound = bound_axes()
    missing = [a for a in axes if a not in bound]
    if missing:
        raise NameError(
            f"jaxsync: {what} {missing[0]!r} is not bound here; bound axes: "
            f"{bound or 'none (not inside shard_map, pmap or vmap)'}. Fix: call the "
            "transform inside jax.shard_map / jax.pmap / jax.vmap with "
            f"axis_name={missing[0]!r}, or pass the axis names that are bound.")


def axes_size(axes: Axes) -> int:
    n = 1
    for a in axes:
        n *= lax.axis_size(a)
    return n


class AxisOps:
    """Collectives over XLA axes (the intra-process stage, or a mesh backend)."""

    def __init__(self, axes: Axes, wire16: bool = False, unit_axes: Axes = ()):
        self.axes = tuple(axes)
        # Axes of size 1 left out of ``axes`` (nothing to reduce over them); the
        # inter-process stage types its results invariant over them.
        self.unit_axes = tuple(unit_axes)
        # False: 16-bit data is summed as float32 by one all-reduce (in-process
        # traffic). True: it travels as 16-bit payloads (see sum_buffers).
        self.wire16 = wire16

    @property
    def size(self) -> int:
        return axes_size(self.axes)

    def allreduce(self, bufs: list) -> list:
        if not self.axes or not bufs:
            return list(bufs)
        return list(lax.psum(list(bufs), self.axes))

    def alltoall(self, x):
        """``x`` has shape (size, m): row j goes to peer j; returns rows from peers."""
        if not self.axes:
            return x
        return lax.all_to_all(x, self.axes, 0, 0, tiled=True)

    def allgather(self, x):
        """``x`` of shape (m,) -> (size, m); the result is replicated."""
        if not self.axes:
            return x[None]
        if _all_gather_invariant is not None and not _is_batched(x):
            return _all_gather_invariant(x, self.axes, axis=0, tiled=False)
        return lax.all_gather(x, self.axes, axis=0, tiled=False)

    def reduce_scatter(self, x):
        if not self.axes:
            return x
        return lax.psum_scatter(x, self.axes, scatter_dimension=0, tiled=True)

    def allgather_tiled(self, x):
        """Concatenate the slices of all members; the result is replicated."""
        if not self.axes:
            return x
        if _all_gather_invariant is not None and not _is_batched(x):
            return _all_gather_invariant(x, self.axes, axis=0, tiled=True)
        return lax.all_gather(x, self.axes, axis=0, tiled=True)

    def broadcast(self, bufs: list, root: int = 0) -> list:
        if not self.axes:
            return bufs
        idx = lax.axis_index(self.axes)
        return [lax.psum(jnp.where(idx == root, b, jnp.zeros_like(b)), self.axes)
                for b in bufs]


class LocalBackend:
    """No inter-process stage: one process."""

    name = "none"
    mesh_axes: tuple = ()

    def size(self) -> int:
        return 1

    def run(self, program, bufs, intra: AxisOps, leader_only: bool, group_bytes=None):
        del intra, leader_only, group_bytes
        return program(AxisOps(()), bufs)

    def agree(self, text: str, what: str, bufs: list) -> list:
        del text, what
        return bufs

    def __repr__(self):
        return "LocalBackend()"


@dataclasses.dataclass(frozen=True)
class AxisComm:
    """Use a mesh axis, reduced by XLA, as the inter-process stage.

    Pass it as ``comm=jaxsync.AxisComm("host")`` and run the step under
    ``shard_map`` over a mesh with axes ``("host", "local")``: in one process
    that simulates hosts on fake devices; after ``jax.distributed.initialize``
    the same code spans real processes (gloo collectives on CPU, NCCL on GPU).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxsync
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("host", "local"))
      >>> tx = jaxsync.hierarchical_mean(axis_name="local",
      ...                                comm=jaxsync.AxisComm("host"))
      >>> def f(g):
      ...     out, _ = tx.update({"g": g}, tx.init({"g": g}))
      ...     return out["g"]
      >>> g = jnp.arange(8.0)  # replica i holds the value i
      >>> jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(("host", "local")),
      ...                       out_specs=P(("host", "local"))))(g)
      Array([3.5, 3.5, 3.5, 3.5, 3.5, 3.5, 3.5, 3.5], dtype=float32)
    """

    axis_name: Any

    def __post_init__(self):
        if not isinstance(self.axis_name, str):
            raise TypeError(
                f"AxisComm got unexpected type for argument 'axis_name' (expected: "
                f"str, got: {type(self.axis_name).__name__}). Fix: AxisComm('host').")


class AxisBackend:
    """Inter-process stage over a mesh axis, reduced by XLA."""

    name = "axis"

    def __init__(self, axis: AxisComm):
        self.axis = axis.axis_name
        self.mesh_axes = (axis.axis_name,)

    def size(self) -> int:
        check_axes((self.axis,), "comm axis")
        return lax.axis_size(self.axis)

    def run(self, program, bufs, intra: AxisOps, leader_only: bool, group_bytes=None):
        del intra, leader_only  # XLA runs the collective on every device
        return program(AxisOps((self.axis,), wire16=True), bufs)

    def agree(self, text: str, what: str, bufs: list) -> list:
        del text, what  # one program, traced once: nothing can disagree
        return bufs

    def __repr__(self):
        return f"AxisBackend({self.axis!r})"


class _NativeOps:
    """MPI collectives through jaxsync's native FFI targets, in one token chain.

    ``comm`` and ``active`` are traced int32 scalars: the communicator's
    Fortran handle and whether this device talks to the other processes (0: the
    calls return at once, buffers untouched).
    """

    # The allreduce sums float16/bfloat16 buffers itself: all-to-all of the
    # 16-bit payload, float32 sums in rank order, one rounding, all-gather.
    sum16 = True

    def __init__(self, comm, active, size, invariant=(), group=_mpi.GROUP_BYTES):
        self.comm = comm
        self.active = active
        self.size = size
        self.invariant = tuple(invariant)
        self.group = group

    def _call(self, kind, xs):
        token, ys = _mpi.native_call(kind, xs, _mpi.chain_token(), self.comm,
                                     self.active, self.size, self.invariant,
                                     group=self.group)
        _mpi.set_chain_token(token)
        return ys

    def allreduce(self, bufs):
        return self._call("allreduce", list(bufs)) if bufs else []

    def alltoall(self, x):
        return self._call("alltoall", [x])[0]

    def allgather(self, x):
        return self._call("allgather", [x])[0]


class _MPIOps:
    """mpi4jax's collectives (non-CPU platforms), one call per buffer, chained."""

    def __init__(self, comm):
        self.comm = comm
        self.size = comm.Get_size()

    def _call(self, kind, x):
        y, token = _mpi.call(kind, x, _mpi.chain_token(), self.comm)
        _mpi.set_chain_token(token)
        return y

    def allreduce(self, bufs):
        return [self._call("allreduce", b) for b in bufs]

    def alltoall(self, x):
        return self._call("alltoall", x)

    def allgather(self, x):
        return self._call("allgather", x)


class _HostOps:
    """Host-staged collectives: device -> host numpy -> mpi4py -> device.

    Every callback takes and returns a one-byte dependency, so the callbacks of
    one program run in program order on every process (independent callbacks
    may otherwise run in any order and MPI would match the wrong buffers). They
    are ``io_callback``s: MPI calls are side effects that JAX must neither drop
    nor repeat (it may do both with a ``pure_callback``); unordered, since JAX
    refuses ordered effects in multi-device computations - the dependency
    chain orders them.
    """

    def __init__(self, comm):
        self.comm = comm
        self.size = comm.Get_size()

    def _call(self, fn, xs, out_structs):
        def host(dep, *xs):
            del dep
            outs = fn(*[np.ascontiguousarray(x) for x in xs])
            return (*outs, np.zeros((), np.uint8))

        # One dependency chain per traced step, across synchronisations too.
        dep = _mpi.chain_value("host", lambda: jnp.zeros((), jnp.uint8))
        structs = (*out_structs, jax.ShapeDtypeStruct((), jnp.uint8))
        *ys, dep = io_callback(host, structs, dep, *xs, ordered=False)
        _mpi.set_chain_value("host", dep)
        return ys

    def allreduce(self, bufs):
        from mpi4py import MPI
        comm = self.comm

        def host_allreduce(*xs):
            outs = [np.empty_like(x) for x in xs]
            for x, out in zip(xs, outs):
                comm.Allreduce(x, out, op=MPI.SUM)
            return outs

        if not bufs:
            return []
        return self._call(host_allreduce, bufs,
                          [jax.ShapeDtypeStruct(b.shape, b.dtype) for b in bufs])

    def alltoall(self, x):
        comm = self.comm

        def host_alltoall(x):
            out = np.empty_like(x)
            comm.Alltoall(x.view(np.uint8), out.view(np.uint8))
            return [out]

        return self._call(host_alltoall, [x], [jax.ShapeDtypeStruct(x.shape, x.dtype)])[0]

    def allgather(self, x):
        comm = self.comm
        size = self.size

        def host_allgather(x):
            out = np.empty((size, *x.shape), x.dtype)
            comm.Allgather(x.view(np.uint8), out.view(np.uint8))
            return [out]

        return self._call(host_allgather, [x],
                          [jax.ShapeDtypeStruct((size, *x.shape), x.dtype)])[0]


def _check_host_mpi() -> None:
    """What ``_mpi._load`` checks for the device path, for host staging.

    Host callbacks of several local devices call MPI from their own threads, so
    MPI must provide ``MPI_THREAD_MULTIPLE``; computations still in flight at
    exit must finish their MPI calls before ``MPI_Finalize``.
    """
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - depends on install
        raise _mpi.MPIUnavailableError(
            "jaxsync needs mpi4py for inter-process communication (comm=...); "
            "install it with `pip install 'jaxsync[mpi]'`, or pass comm=None.") from e
    _register_drain()
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError(
            "jaxsync needs MPI initialised with MPI_THREAD_MULTIPLE (each local "
            f"device runs in its own thread); MPI provides level {MPI.Query_thread()}. "
            "Do not set mpi4py.rc.thread_level to a lower level.")


@functools.lru_cache(maxsize=None)
def _register_drain() -> None:
    import atexit
    # Registered after mpi4py's MPI_Finalize handler, so it runs before it.
    atexit.register(_mpi._drain)


def share_invariant(tree, axes: Axes):
    """Gradients that autodiff already summed over some axes take part once.

    Under ``shard_map`` (with ``check_vma``), the gradient of a parameter that
    entered replicated (``in_specs=P()``) comes out *invariant* over the mesh
    axes: autodiff already summed the per-device gradients. Summing it again
    would multiply it by the axis size. Such a leaf keeps its value on device 0
    of the axes it is invariant over and becomes zero on the others, so the
    usual sum counts it exactly once and the mean stays right (bit-exact: adding
    zeros changes only the sign of a zero).
    """
    if not axes:
        return tree
    typed = set(_vma(lax.axis_index(axes)))
    if not typed:  # vmap, pmap, or check_vma=False: values carry no axis types
        return tree

    def share(x):
        if str(x.dtype) not in ("float16", "bfloat16", "float32", "float64"):
            return x
        have = _vma(x)
        inv = tuple(a for a in axes if a in typed and a not in have)
        if not inv:
            return x
        if axes_size(inv) == 1:  # one member: it is counted once as it is
            return _varying(x, inv)
        first = lax.axis_index(inv) == 0
        return jnp.where(first, _varying(x, inv), jnp.zeros_like(x))

    return jax.tree.map(share, tree)


def _after(x, prev):
    """``x`` with a data dependency on ``prev`` that XLA cannot remove.

    The first element of ``x`` is XOR-ed with (first element of ``prev`` AND a
    zero that comes from a host callback): the value is unchanged bit for bit.
    """
    if x.size == 0 or prev.size == 0:
        return x
    uint = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}
    width, pwidth = uint[x.dtype.itemsize], uint[prev.dtype.itemsize]
    zero = jax.pure_callback(lambda: np.zeros((), width), jax.ShapeDtypeStruct((), width),
                             vmap_method="broadcast_all")
    head = lax.bitcast_convert_type(lax.slice(x, (0,), (1,)), width)
    dep = lax.bitcast_convert_type(lax.slice(prev.reshape(-1), (0,), (1,)), pwidth)
    dep = lax.convert_element_type(dep, width) & zero
    head = lax.bitcast_convert_type(head ^ _varying(dep, _vma(head)), x.dtype)
    return lax.dynamic_update_slice(x, head, (0,))


def _vma(x) -> tuple:
    """The shard_map axes over which ``x`` is typed as varying."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    vma = mat.varying if mat is not None else getattr(aval, "vma", ())
    return tuple(sorted(vma or (), key=str))


def _varying(x, axes):
    """Mark ``x`` as varying over ``axes`` (shard_map's manual-axis types)."""
    have = _vma(x)
    missing = tuple(a for a in axes if a not in have)
    return lax.pcast(x, missing, to="varying") if missing else x


class MPIBackend:
    """Inter-process stage over MPI.

    Args:
      comm: an mpi4py intra-communicator; jaxsync duplicates it once and never
        sends on the user's handle.
      staging: ``"device"`` (default) calls MPI on the device buffers: on CPU
        through jaxsync's native FFI targets (zero-copy, in place, one call for
        all 32/64-bit buffers of a synchronisation); on GPU through mpi4jax's
        targets (staged through host unless ``MPI4JAX_USE_CUDA_MPI=1``).
        ``"host"`` copies each buffer to host memory and calls mpi4py
        (ChainerMN's ``non_cuda_aware``): works with any MPI, costs a
        device-to-host copy each way.
    """

    name = "mpi"
    mesh_axes: tuple = ()

    def __init__(self, comm, staging: str = "device", timeout: float | None = None):
        self.native = staging == "device" and jax.default_backend() == "cpu"
        if self.native:
            _mpi.require_native()  # a clear error now, never a slow fallback
        elif staging == "device":
            _mpi._load_mpi4jax()
        else:
            _check_host_mpi()
        self.comm = comm
        self.staging = staging
        self.timeout = timeout
        # Every communicator this backend will use is made now, when the factory
        # is called (on every process): never while tracing, which a process may
        # do alone (eval_shape, lower, make_jaxpr on rank 0).
        self.comms.prepare(jax.local_device_count())
        if timeout is not None:
            self.comms.watchdog(timeout)

    def _watched(self, program, watch, when=None):
        if self.timeout is None or not watch:
            return program
        return self.comms.watchdog(self.timeout).wrap(program, when)

    @functools.cached_property
    def comms(self) -> Comms:
        return Comms.of(self.comm)

    def size(self) -> int:
        return self.comm.Get_size()

    def _ops(self, comm):
        return _HostOps(comm) if self.staging == "host" else _MPIOps(comm)

    def run(self, program, bufs, intra: AxisOps, leader_only: bool, group_bytes=None):
        """Run ``program(ops, bufs)`` with ``ops`` reducing across processes.

        Every inter-process call of a traced step takes the token (or host
        dependency) of the previous one, across synchronisations too, so every
        process issues them in the same order.
        """
        if not bufs:
            return []
        if self.native:
            return self._run_native(program, list(bufs), intra, leader_only, group_bytes)
        return self._run(program, list(bufs), intra, leader_only)

    def _run_native(self, program, bufs, intra: AxisOps, leader_only: bool, group_bytes):
        comms = self.comms
        group = _mpi.GROUP_BYTES if group_bytes is None else group_bytes
        size = comms.size
        one = jnp.int32(1)
        world = jnp.int32(comms.world.py2f())
        if not intra.axes:
            # One device per process: no leader choice, no broadcast; results
            # typed invariant over the local axes of size 1 (if any).
            ops = _NativeOps(world, one, size, intra.unit_axes, group)
            return self._watched(program, True)(ops, bufs)
        idx = lax.axis_index(intra.axes)
        if _is_batched(idx):
            # Under vmap all replicas live in one program: one ordered chain on
            # the world communicator, every replica a row of the same message.
            return self._watched(program, True)(_NativeOps(world, one, size, group=group), bufs)
        leader = idx == 0
        if leader_only:
            # Every device makes the call; only local device 0 talks MPI, the
            # others return their (aliased) input untouched. Typed varying over
            # the local axes, as it is; the broadcast makes it invariant again.
            active = leader.astype(jnp.int32)
            bufs = [_varying(b, _vma(active)) for b in bufs]
            out = self._watched(program, True, leader)(
                _NativeOps(world, active, size, group=group), bufs)
            return intra.broadcast(list(out), root=0)
        # Every device its own communicator (the world split by local index),
        # picked at run time: no lax.switch.
        handles = np.array([c.py2f() for c in comms.per_device(intra.size)], np.int32)
        comm = jnp.asarray(handles)[idx]
        return self._watched(program, True, leader)(_NativeOps(comm, one, size, group=group), bufs)

    def _run(self, program, bufs, intra: AxisOps, leader_only: bool):
        """Host staging, and mpi4jax's targets off CPU: leader chosen by lax.cond."""
        comms = self.comms
        if not intra.axes:
            return self._watched(program, True)(self._ops(comms.world), bufs)
        idx = lax.axis_index(intra.axes)
        if _is_batched(idx):
            return self._watched(program, True)(self._ops(comms.world), bufs)
        # Tokens (and the chain inside a branch) cannot leave lax.cond: the
        # previous synchronisation of this trace is tied to this one by data.
        prev = _mpi.chain_value("cond", lambda: None)
        if prev is not None:
            bufs = [_after(bufs[0], prev), *bufs[1:]]
        out = self._run_cond(program, bufs, intra, leader_only, idx)
        head = next((y.reshape(-1)[:1] for y in out if y.size), None)
        if head is not None:  # one element: all the next tie needs
            _mpi.set_chain_value("cond", head)
        return out

    def _run_cond(self, program, bufs, intra, leader_only, idx):
        comms = self.comms

        def on(comm, watch, bs):
            # Results keep the inputs' shard_map axis types, so branches agree
            # and a replicated input gives a replicated (invariant) result.
            out = self._watched(program, watch)(self._ops(comm), bs)
            return [_varying(y, _vma(b)) for y, b in zip(out, bs)]

        if leader_only:
            out = lax.cond(idx == 0, functools.partial(on, comms.world, True), list, bufs)
            return intra.broadcast(list(out), root=0)
        per_dev = comms.per_device(intra.size)
        branches = [functools.partial(on, c, k == 0) for k, c in enumerate(per_dev)]
        return list(lax.switch(idx, branches, bufs))

    def agree(self, text: str, what: str, bufs: list) -> list:
        """Compare ``text`` across processes before ``bufs`` travel.

        Returns ``bufs`` tied to a check that, the first time the compiled step
        runs, exchanges a digest of ``text`` (the full texts only on a
        mismatch) and fails the step with the same message on every process
        when they differ: a native call on CPU (``_mpi.register_agreement``),
        a host callback elsewhere (``_agree``). Tracing alone never blocks.
        """
        if not bufs:
            return bufs
        if self.native:
            # A native call checks it (the first time a process runs it; then a
            # table look-up): no host callback in the step, which would put jit's
            # dispatch on its slow path. It comes first in the token chain, and
            # an optimization barrier makes every buffer (so every local and MPI
            # collective of this synchronisation) wait for it, without a copy.
            key = _mpi.register_agreement(self.comms.agreement, text, what, _disagreement)
            # How many devices of this process run the check (vmap: one program).
            devices = int(np.prod([n for a, n in bound_axes().items()
                                   if not _is_batched(lax.axis_index(a))], dtype=np.int64))
            token, (dep,) = _mpi.native_call(
                "agree", [jnp.zeros((1,), jnp.uint8)], _mpi.chain_token(),
                jnp.int32(self.comms.world.py2f()), jnp.int32(1), self.comms.size,
                agree=(*key, devices))  # (comm, id, instance, devices)
            _mpi.set_chain_token(token)
            return list(lax.optimization_barrier((dep, *bufs))[1:])
        from ._agree import agreement_dep, tie_buffers
        return tie_buffers(bufs, agreement_dep(self.comms.agreement, text, what,
                                               _disagreement))

    def __repr__(self):
        return (f"MPIBackend(size={self.size()}, staging={self.staging!r}, "
                f"timeout={self.timeout})")


_FIXES = {
    "gradient tree": "make every process build the same gradient tree (same structure, "
                     "shapes and dtypes), drive the same number of devices, and create "
                     "the transform with the same options",
    "parameter tree": "call broadcast_params on every process with a tree of the same "
                      "structure, shapes and dtypes (only the values may differ)",
}


def _disagreement(texts: Sequence[str], what: str) -> str:
    """Name the first two ranks that differ and their first differing line."""
    base = texts[0]
    other = next(r for r, t in enumerate(texts) if t != base)
    a, b = base.splitlines(), texts[other].splitlines()
    for la, lb in zip(a + [""] * (len(b) - len(a)), b + [""] * (len(a) - len(b))):
        if la != lb:
            break
    w = len(f"rank {other}:")
    return (f"jaxsync: the {what} differs between rank 0 and rank {other}, so the "
            f"processes would issue different collectives (a hang or wrong results).\n"
            f"  {'rank 0:':<{w}} {la or '<nothing>'}\n  {f'rank {other}:':<{w}} "
            f"{lb or '<nothing>'}\nFix: {_FIXES.get(what, 'make every process agree')}.")

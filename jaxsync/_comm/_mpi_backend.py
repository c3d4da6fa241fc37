"""The MPI inter-process stage: ``MPIBackend``.

``MPIBackend.run(program, bufs, intra, leader_only)`` runs ``program(ops,
bufs)`` with ``ops`` reducing across processes (``_mpi_ops``): jaxsync's native
FFI targets on CPU, mpi4jax's elsewhere, or host staging through mpi4py, with a
token (or host dependency) that fixes the order of every call. It picks the
leader device, the communicators (``_topology.Comms``), the stall watchdog and
the cross-process agreement check.

Imports: the collective modules below it (``_intra``, ``_invariance``,
``_ordering``, ``_mpi_load``, ``_mpi_ops``, ``_native_prim``, ``_quiet``),
``_agree``, ``_topology`` and ``_host_tier``; none of those imports it (the transforms, compression,
sparse sync, ``auto`` and ``tune`` do).
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _abort, _host_tier, _mpi_load, _native_prim, _ordering, _quiet
from ._agree import _disagreement, agreement_dep, keep_alive, reach_site, tie_buffers
from ._intra import AxisOps, _is_batched, bound_axes
from ._invariance import _varying, _vma
from ._mpi_ops import _HostOps, _MPIOps, _NativeOps
from ._ordering import _after
from ._topology import Comms

_BACKENDS = itertools.count(1)  # MPI transforms made by this process, in order
_SITES = itertools.count(1)  # traced inter-process stages (the watchdog's sites)


def _check_host_mpi() -> None:
    """What ``_mpi_load._load`` checks for the device path, for host staging.

    Host callbacks of several local devices call MPI from their own threads, so
    MPI must provide ``MPI_THREAD_MULTIPLE``; computations still in flight at
    exit must finish their MPI calls before ``MPI_Finalize``.
    """
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - depends on install
        raise _mpi_load.MPIUnavailableError(
            "jaxsync needs mpi4py for inter-process communication (comm=...); "
            "install it with `pip install 'jaxsync[mpi]'`, or pass comm=None."
        ) from e
    _register_drain()
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError(
            "jaxsync needs MPI initialised with MPI_THREAD_MULTIPLE (each local "
            f"device runs in its own thread); MPI provides level {MPI.Query_thread()}. "
            "Do not set mpi4py.rc.thread_level to a lower level."
        )


@functools.cache
def _register_drain() -> None:
    import atexit

    # Registered after mpi4py's MPI_Finalize handler, so it runs before it.
    atexit.register(_quiet._drain)


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
      timeout, on_timeout: the stall watchdog (``_watchdog``): seconds in one
        inter-process stage (``None``: off), then ``"report"`` or ``"abort"``.
      name: the factory, for the watchdog's messages (``"hierarchical_mean #1"``).
    """

    name = "mpi"
    mesh_axes: tuple = ()

    def __init__(
        self,
        comm,
        staging: str = "device",
        timeout: float | None = None,
        on_timeout: str = "report",
        name: str = "MPI",
    ):
        self.native = staging == "device" and not _mpi_load.uses_mpi4jax()
        if self.native:
            _mpi_load.require_native()  # a clear error now, never a slow fallback
        elif staging == "device":
            _mpi_load._load_mpi4jax()
            if jax.default_backend() == "cpu":
                # The GPU path tested on CPU: ``_tie.tie``, which orders its calls
                # through control flow, needs the native no-op there (XLA:CPU
                # drops optimization barriers).
                _mpi_load.require_native()
        else:
            _check_host_mpi()
        self.comm = comm
        self.staging = staging
        _abort.install(comm)  # an uncaught exception ends the job (_abort)
        self.timeout = timeout
        self.on_timeout = on_timeout
        # The watchdog names the synchronisation: the factory and how many MPI
        # transforms this process made before it (the same on every process:
        # they make them together, in the same order).
        self.label = f"{name} #{next(_BACKENDS)}"
        # Every communicator this backend will use is made now, when the factory
        # is called (on every process): never while tracing, which a process may
        # do alone (eval_shape, lower, make_jaxpr on rank 0).
        self.comms.prepare(jax.local_device_count())
        if timeout is not None:
            self.comms.watchdog(timeout, on_timeout)

    # -- the stall watchdog: enter/leave hooks around each inter-process stage --
    def _watchdog(self):
        return self.comms.watchdog(self.timeout, self.on_timeout)

    def _stage_name(self) -> str:
        """This stage's name: the synchronisation and its stage within the trace."""
        key = f"watch-stage-{id(self)}"
        k = _ordering.chain_value(key, lambda: 0)
        _ordering.set_chain_value(key, k + 1)
        return self.label if k == 0 else f"{self.label} (stage {k + 1})"

    def _take_entered(self):
        """``(site, name, True)``: the stage ``agree`` entered (or None), taken once."""
        if self.timeout is None:
            return None
        key = f"watch-entered-{id(self)}"
        got = _ordering.chain_value(key, lambda: None)
        _ordering.set_chain_value(key, None)
        return got

    def _new_stage(self) -> tuple:
        """``(site, name, entered)`` of a stage not entered yet."""
        return next(_SITES), self._stage_name(), False

    def _watched(self, program, watch, when=None, stage=None):
        """``program`` with the watchdog's hooks (``stage``: see ``_new_stage``)."""
        if self.timeout is None or not watch:
            return program
        site, name, entered = self._new_stage() if stage is None else stage
        return self._watchdog().wrap(program, site, name, when, entered=entered)

    @functools.cached_property
    def comms(self) -> Comms:
        return Comms.of(self.comm)

    def size(self) -> int:
        return self.comm.Get_size()

    def _ops(self, comm):
        return _HostOps(comm) if self.staging == "host" else _MPIOps(comm)

    def run(self, program, bufs, intra: AxisOps, leader_only: bool, group_bytes=None, tiered=False):
        """Run ``program(ops, bufs)`` with ``ops`` reducing across processes.

        Every inter-process call of a traced step takes the token (or host
        dependency) of the previous one, across synchronisations too, so every
        process issues them in the same order. ``tiered``: ``program`` is a sum
        that may run over the hosts, the processes of each host reduced first
        (the host tier, see :meth:`tier`).
        """
        if not bufs:
            return []
        entered = self._take_entered()
        if self.native:
            tier = self.tier(leader_only) if tiered else None
            return self._run_native(
                program, list(bufs), intra, leader_only, group_bytes, tier, entered
            )
        return self._run(program, list(bufs), intra, leader_only, entered)

    def tier(self, leader_only: bool):
        """The host tier a tiered sum uses (a ``_topology.HostTier``), or None.

        jaxsync's native targets only (CPU, ``staging="device"``); with hosts
        of unequal process counts, ``leader_only`` ones only (a reduce-scatter
        over the host needs the same slices on every host).
        """
        t = self.comms.tier if self.native else None
        return t if t is not None and (leader_only or t.uniform) else None

    def _run_native(
        self, program, bufs, intra: AxisOps, leader_only: bool, group_bytes, tier, entered=None
    ):
        comms = self.comms
        group = _native_prim.GROUP_BYTES if group_bytes is None else group_bytes
        size = comms.size
        one = jnp.int32(1)
        world = jnp.int32(comms.world.py2f())
        # The world's communicators (and their per-device splits) span hosts
        # when the job does; a tier's host communicator never, its cross one always.
        span = functools.partial(_NativeOps, spans_hosts=comms.hosts > 1)

        if tier is not None and intra.size > len(tier.host):
            comms.per_device(intra.size)  # more replicas than devices: made now
            tier = self.tier(leader_only)

        def tiered(comm_index, active, invariant=()):
            # Devices of a process first (done), then processes of a host, then
            # hosts: the host's communicators of this device (comm_index).
            pick = lambda cs: jnp.asarray(np.array([c.py2f() for c in cs], np.int32))[comm_index]
            host = _NativeOps(pick(tier.host), active, tier.local_size, invariant, group)
            lead = active * jnp.int32(tier.local_rank == 0) if leader_only else active
            cross = _NativeOps(
                pick(tier.cross), lead, tier.hosts, invariant, group, spans_hosts=True
            )
            return _host_tier.program(program, host, cross, leader_only)

        if not intra.axes:
            # One device per process: no leader choice, no broadcast; results
            # typed invariant over the local axes of size 1 (if any).
            ops = span(world, one, size, intra.unit_axes, group)
            if tier is not None:
                return self._watched(tiered(0, one, intra.unit_axes), True, None, entered)(
                    ops, bufs
                )
            return self._watched(program, True, None, entered)(ops, bufs)
        idx = lax.axis_index(intra.axes)
        if _is_batched(idx):
            # Under vmap all replicas live in one program: one ordered chain on
            # the world communicator, every replica a row of the same message.
            ops = span(world, one, size, group=group)
            return self._watched(program, True, None, entered)(ops, bufs)
        leader = idx == 0
        if leader_only:
            # Every device makes the call; only local device 0 talks MPI, the
            # others return their (aliased) input untouched. Typed varying over
            # the local axes, as it is; the broadcast makes it invariant again.
            active = leader.astype(jnp.int32)
            bufs = [_varying(b, _vma(active)) for b in bufs]
            ops = span(world, active, size, group=group)
            run = program if tier is None else tiered(0, active)
            out = self._watched(run, True, leader, entered)(ops, bufs)
            return intra.broadcast(list(out), root=0)
        if tier is not None:  # every device its slice through its own communicators
            return self._watched(tiered(idx, one), True, leader, entered)(None, bufs)
        # Every device its own communicator (the world split by local index),
        # picked at run time: no lax.switch.
        handles = np.array([c.py2f() for c in comms.per_device(intra.size)], np.int32)
        comm = jnp.asarray(handles)[idx]
        ops = span(comm, one, size, group=group)
        return self._watched(program, True, leader, entered)(ops, bufs)

    def _run(self, program, bufs, intra: AxisOps, leader_only: bool, entered=None):
        """Host staging, and mpi4jax's targets off CPU: leader chosen by lax.cond."""
        comms = self.comms
        if not intra.axes:
            return self._watched(program, True, None, entered)(self._ops(comms.world), bufs)
        idx = lax.axis_index(intra.axes)
        if _is_batched(idx):
            return self._watched(program, True, None, entered)(self._ops(comms.world), bufs)
        if self.staging == "device":  # mpi4jax: the chain crosses the cond (_ordering)
            return self._run_cond(program, bufs, intra, leader_only, idx, entered)
        # Host staging's chain cannot leave lax.cond: the previous
        # synchronisation of this trace is tied to this one by data.
        prev = _ordering.chain_value("cond", lambda: None)
        if prev is not None:
            bufs = [_after(bufs[0], prev), *bufs[1:]]
        out = self._run_cond(program, bufs, intra, leader_only, idx, entered)
        head = next((y.reshape(-1)[:1] for y in out if y.size), None)
        if head is not None:  # one element: all the next tie needs
            _ordering.set_chain_value("cond", head)
        return out

    def _run_cond(self, program, bufs, intra, leader_only, idx, entered=None):
        comms = self.comms
        if self.timeout is not None and entered is None:
            entered = self._new_stage()  # named in the trace around the branches

        def on(comm, watch, bs):
            # Results keep the inputs' shard_map axis types, so branches agree
            # and a replicated input gives a replicated (invariant) result.
            out = self._watched(program, watch, None, entered)(self._ops(comm), bs)
            return [_varying(y, _vma(b)) for y, b in zip(out, bs)]

        if leader_only:
            out = lax.cond(idx == 0, functools.partial(on, comms.world, True), list, bufs)
            return intra.broadcast(list(out), root=0)
        per_dev = comms.per_device(intra.size)
        branches = [functools.partial(on, c, k == 0) for k, c in enumerate(per_dev)]
        return list(lax.switch(idx, branches, bufs))

    def agree(self, text: str, what: str, bufs: list, alone: bool = False) -> list:
        """Check the synchronisation's header across processes before ``bufs`` travel.

        Returns ``bufs`` tied to the check. On CPU (jaxsync's native target)
        every run of the step exchanges the header, a digest of ``text`` and
        how many times this process reached the synchronisation (16 bytes), and
        fails the step with the same message on every process when they differ
        (``agree.cc``; the full texts travel only on a mismatch). Elsewhere a
        host callback compares the digest the first time the compiled step runs
        (``_agree``). With nothing to travel the check runs all the same: a
        process with nothing to reduce must not leave the others waiting.
        Tracing alone never blocks. ``alone``: a check with no stage after it
        (a configuration's, ``jaxsync.local``): with the watchdog it is a stage
        of its own, left by a host callback once it has passed, which keeps it
        in the step; ``bufs`` then come back untied (tied to the leader
        device's callback, they would be typed varying under ``shard_map``).
        """
        # With the watchdog, the synchronisation's first stage is entered here,
        # before the agreement: a first execution waiting in it is watched too.
        start, leave = jnp.zeros((1,), jnp.uint8), None
        if self.timeout is not None and (bufs or alone):
            site, name, _ = self._new_stage()
            when = _one_device()
            if when is not None:
                start = _varying(start, _vma(when))
            start = self._watchdog().enter_before(start, site, name, when)
            if alone:  # left after the check (a host callback nothing reads)
                leave = functools.partial(self._watchdog().leave_after, site=site, when=when)
            else:  # left by the synchronisation's first stage (``run``)
                _ordering.set_chain_value(f"watch-entered-{id(self)}", (site, name, True))
        if self.native:
            # A native call checks it: no host callback in the step, which would
            # put jit's dispatch on its slow path. It comes first in the token
            # chain, and an optimization barrier makes every buffer (so every
            # local and MPI collective of this synchronisation) wait for it,
            # without a copy.
            comm, ident, instance = _mpi_load.register_agreement(
                self.comms.agreement, text, what, _disagreement
            )
            # How many devices of this process run the check (vmap: one program).
            devices = int(
                np.prod(
                    [n for a, n in bound_axes().items() if not _is_batched(lax.axis_index(a))],
                    dtype=np.int64,
                )
            )
            step, site = _reached(comm, ident)
            token, (dep, _) = _native_prim.native_call(
                "agree",
                [start, step],
                _ordering.chain_token(),
                jnp.int32(self.comms.world.py2f()),
                jnp.int32(1),
                self.comms.size,
                agree=(comm, ident, instance, devices, site),
            )
            _ordering.set_chain_token(token)
            if not bufs:
                keep_alive(dep)
            # One barrier per buffer: each waits for the check, none for the
            # others (a bucket of an overlapped step travels as soon as it exists).
            if leave is not None:
                leave(dep)
                return list(bufs)
            return [lax.optimization_barrier((dep, b))[1] for b in bufs]
        after = None if self.timeout is None else start
        dep = agreement_dep(self.comms.agreement, text, what, _disagreement, after=after)
        if leave is not None:
            leave(dep)
            return list(bufs)
        if not bufs:
            keep_alive(dep)
        return tie_buffers(bufs, dep)

    def __repr__(self):
        return f"MPIBackend(size={self.size()}, staging={self.staging!r}, timeout={self.timeout})"


def _one_device():
    """A traced boolean, true on one device of this process (index 0 along
    every bound, unmapped axis); ``None`` where one program runs per process
    (no such axis: plain ``jit``, or only ``vmap``)."""
    axes = [a for a in bound_axes() if not _is_batched(lax.axis_index(a))]
    if not axes:
        return None
    return functools.reduce(jnp.logical_and, [lax.axis_index(a) == 0 for a in axes])


def _reached(comm: int, ident: int):
    """``(operand, site)`` of a synchronisation's ``jaxsync_agree``: int32[2],
    this device's index and, where the synchronisation sits in control flow,
    the count of steps that reached it (``jaxsync_step``, at the top of the
    traced step, whichever branch then runs), else -1 (reached when it runs)."""
    site, top = reach_site(ident)

    def device():
        axes = tuple(a for a in bound_axes() if not _is_batched(lax.axis_index(a)))
        return lax.axis_index(axes).astype(jnp.int32) if axes else jnp.int32(0)

    if top is None:
        return jnp.stack([device(), jnp.int32(-1)]), site
    from jax._src import core

    with core.set_current_trace(top):
        d = device()
        # In the top trace's chain (it moves nothing; the control-flow operation
        # then depends on it through the count, so the step keeps one chain).
        entry = _ordering._entry(top, prune=False)
        token = entry.get("token")
        token, (count,) = _native_prim.native_call(
            "step", [d], lax.create_token() if token is None else token, jnp.int32(0),
            jnp.int32(0), 1, agree=(comm, ident, 0, 0, site),
        )  # fmt: skip
        entry["token"] = token
        return jnp.stack([d, count]), site

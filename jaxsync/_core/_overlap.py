"""Overlap and double buffering: gradients travel while the step computes.

``run_async`` runs a strategy once per bucket, in the order backward produces
the gradients, inside ``_async.asynchronous()`` (``overlap=True``); ``double_buffer_fns``
is ``double_buffering=True``'s init/update pair (ChainerMN's double-buffering optimizer);
``warn_no_inter_stage`` warns where no inter-process stage exists; ``check_overlap``
validates the options, ``resolve_overlap`` decides ``overlap="auto"``.

Imports: jax, ``_async``, ``_invariance``, ``_tie``, ``_plugins``, ``_strategies``;
``_config`` (defaults, checks, ``bad_type``), ``_sync``, ``_quantsum`` import it.
"""

from __future__ import annotations

import contextvars
import os
import sys
import types
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxsync._comm._async import asynchronous
from jaxsync._comm._invariance import share_invariant
from jaxsync._comm._tie import tie

from . import _plugins, _strategies

# overlap=True: gradients travel in buckets of about this many bytes, issued in
# the order backward produces them; the first (the last layers') is smaller so
# the network starts early (DDP: 25 MB buckets, the first 1 MB). Measured on
# the emulated 1 Gb/s cluster and in shared memory (docs/benchmarks.md).
OVERLAP_BUCKET_BYTES = 4 * 2**20
OVERLAP_FIRST_BYTES = 1 * 2**20
_AUTO = "auto"


def resolve_overlap(overlap, backend) -> bool:
    """``overlap`` as a synchronisation takes it. ``"auto"`` (the default): on where
    its inter-process stage spans more than one host (an MPI communicator whose
    processes the topology counts on several hosts, ``Comms.hosts``: there the
    wire sets the time; on the emulated cluster at 100 Mb/s overlap took the step
    to 0.72-0.76x the blocking one, docs/benchmarks.md), off within one host (shared memory:
    nothing to hide, the lowered step unchanged), without MPI (one process,
    ``AxisComm``), and where MPI calls block the device stream (mpi4jax on GPU,
    ``staging="host"``: only jaxsync's native CPU target runs asynchronously, so
    elsewhere buckets would only add calls); ``True`` / ``False`` force it."""
    if not (isinstance(overlap, str) and overlap == _AUTO):
        return bool(overlap)
    hosts = getattr(getattr(backend, "comms", None), "hosts", 0)
    return hosts > 1 and bool(getattr(backend, "native", False))


def overlap_groups(nbytes: list, bucket_bytes: int, first_bytes: int | None = None) -> list:
    """Buffers grouped into overlap buckets, in the order backward produces them.

    Backward produces the gradients of the last layers first: the buffers (in
    the tree's order, the forward order of most models) are taken last to first;
    a bucket closes once it holds ``bucket_bytes`` (the first once it holds
    ``min(first_bytes, bucket_bytes)``: small, so the network starts early, as
    in DDP). Returns lists of buffer indices.

    Example:
      >>> from jaxsync._core._overlap import overlap_groups
      >>> overlap_groups([4, 4, 4, 4, 4], bucket_bytes=8, first_bytes=4)
      [[4], [3, 2], [1, 0]]
    """
    first = OVERLAP_FIRST_BYTES if first_bytes is None else first_bytes
    groups: list = []
    cur: list = []
    held = 0
    for i in reversed(range(len(nbytes))):
        cur.append(i)
        held += nbytes[i]
        if held >= (min(first, bucket_bytes) if not groups else bucket_bytes):
            groups.append(cur)
            cur, held = [], 0
    if cur:
        groups.append(cur)
    return groups


def run_async(cfg, bufs: list, intra, group, tiered=False, runner=None) -> list:
    """The strategy run once per overlap bucket, its MPI sums asynchronous.

    ``overlap``: one call per bucket, issued as backward produces the bucket
    (the token chain orders them), each summed in place on the communicator's
    thread while XLA computes on. ``double_buffering`` alone: the buffers come
    from the state (step t-1's gradients, all there when the step starts), so
    one call sums them all (in place: the results hold their memory until the
    update, so the backward's temporaries never reuse it and wait for the
    network), while this step's forward and backward run. ``runner(idx, bufs)``
    (a quantized wire's schedule, ``_quantsum``) replaces the strategy's sum of
    the buffers ``idx``.
    """
    if cfg.overlap:
        sizes = [int(b.size) * jnp.dtype(b.dtype).itemsize for b in bufs]
        groups = overlap_groups(sizes, cfg.overlap_bucket_bytes)
    else:
        groups = [list(range(len(bufs)))]
    out = list(bufs)
    prev: list = []
    with asynchronous(inplace=True):
        for idx in groups:
            mine = [bufs[i] for i in idx]
            if prev:
                # The last bucket's sums are tied to this bucket's gradients
                # (``tie``: an optimization barrier XLA:CPU keeps): its optimizer
                # update (which overwrites donated parameters) comes after the
                # backward that reads those parameters to make these gradients,
                # so XLA copies no parameter, and its summed buffers stay live
                # until then, so no backward temporary reuses their memory (which
                # would make the backward wait for the network). This bucket's
                # call reads the tie's outputs (no copy either). Nothing waits
                # longer: this bucket's call needs the last one's token (ready
                # when it is done) and these gradients anyway.
                done = [out[i] for i in prev]
                done, mine = tie((done, mine))
                for i, y in zip(prev, done):
                    out[i] = y
            if runner is not None:
                got = runner(idx, mine)
            else:
                got = _strategies.run(cfg.strategy, mine, intra, cfg.backend, group, tiered)
            for i, y in zip(idx, got):
                out[i] = y
            prev = idx
    # Double buffering: the results (the buffers the sums wrote, before any
    # reshape, which would be a copy) wait for this step's gradients. (Overlap
    # alone ties nothing more: each bucket's update waits for its own sum only.)
    after = _AFTER.get()
    return tie(out, after=after) if after else out


# Inside a double-buffered update: this step's gradients, which the reduced
# buffers of the last step's must wait for (read by ``run_async``).
_AFTER: contextvars.ContextVar = contextvars.ContextVar("jaxsync_after", default=())


class DoubleBufferState(NamedTuple):
    """State of a jaxsync transform made with ``double_buffering=True``.

    Attributes:
      pending: this replica's gradients of the last step, not yet reduced (the
        next update reduces and applies them); zeros before the first step.
        Each leaf has its gradient's shape, ``(1,)`` for a scalar (so that under
        ``shard_map`` every device's pending gradient stacks along a first
        axis, as ``P(axis)`` needs). Each replica's own: under
        ``jax.shard_map`` with several local devices, make and pass the state
        with :func:`jaxsync.state_specs`.
      all_finite: with ``check_finite``, whether the last applied gradients
        were all finite (``None`` otherwise).
      wire: with ``comm_dtype=jaxsync.Quantized(...)``, the quantized wire's
        :class:`jaxsync.QuantState` (its residuals, step); ``None`` otherwise.
    """

    pending: Any
    all_finite: Any = None
    wire: Any = None


def double_buffer_fns(fn: str, cfg, sync, wire=None):
    """ChainerMN's double buffering: step t applies the mean of step t-1's gradients.

    The state holds the last step's local gradients. ``update`` reduces them
    (their MPI sums start when the step starts: they depend on the state only,
    so they travel during this step's forward and backward) and keeps the new
    gradients, unreduced, for the next step. The first step reduces the zeros
    ``init`` made: it applies zeros. ``wire``: a quantized wire's ``(init,
    update)`` (``_quantsum.transform_fns``), which then reduces them.
    """

    def init_fn(params):
        pending = jax.tree_util.tree_map(lambda x: _as_pending(jnp.zeros_like(x)), params)
        finite = jnp.array(True) if cfg.check_finite else None
        return DoubleBufferState(pending, finite, wire[0](params) if wire else None)

    def update_fn(updates, state, params=None):
        del params
        if not isinstance(state, DoubleBufferState):
            raise TypeError(
                f"{fn}: update got a state of type {type(state).__name__}, expected "
                "DoubleBufferState from this transform's init (double_buffering=True). "
                "Make sure you have called init first and pass the state returned by "
                "this transform."
            )
        if _plugins.tree_kind(updates) is not None:
            raise TypeError(
                f"{fn}: double_buffering=True keeps the gradients in the state and "
                "does not take RowSparse leaves. Fix: densify them (RowSparse."
                "todense()), or use double_buffering=False."
            )
        got = jax.tree_util.tree_structure(updates)
        want = jax.tree_util.tree_structure(state.pending)
        if got != want:
            raise ValueError(
                f"{fn}: the gradients' tree {got} differs from the tree of the state's "
                f"pending gradients {want} (made by init from the parameters). Fix: "
                "pass gradients with the parameters' structure."
            )
        _check_pending(fn, updates, state.pending)
        # A scalar's pending gradient is kept as (1,): reduced with its own shape.
        last = jax.tree_util.tree_map(
            lambda p, g: p if jnp.ndim(g) else p.reshape(()), state.pending, updates
        )
        # The sums' results are tied to this step's gradients (``run_async``
        # reads them from ``_AFTER``; ``tie``: an optimization barrier XLA:CPU
        # keeps): the update that reads them (and overwrites donated parameters)
        # comes after the backward, so XLA copies no parameter, and the summed
        # buffers stay live through the backward, whose temporaries then never
        # reuse their memory (such reuse made the backward wait for the
        # network: the step took the sum of its compute and its communication).
        reset = _AFTER.set(jax.tree_util.tree_leaves(updates))
        try:
            if wire:
                synced, wired = wire[1](last, state.wire)
                finite = wired.all_finite if cfg.check_finite else None
            else:
                (synced, finite), wired = sync(last, cfg), None
        finally:
            _AFTER.reset(reset)
        # Kept as this replica's share: a gradient autodiff already summed over
        # the local axes (shard_map, replicated parameters) is typed varying in
        # the state, so it is kept on local device 0 only (zeros elsewhere) and
        # the next step's sum counts it once.
        pending = share_invariant(updates, cfg.axes)
        pending = jax.tree_util.tree_map(_as_pending, pending)
        # Written once the last step's gradients are reduced (so after the state
        # was read): XLA may then put them where the donated state was, with one
        # copy (this one) instead of its two (the state in, these out).
        pending = tie(pending, after=jax.tree_util.tree_leaves(synced), fresh=True)
        return synced, DoubleBufferState(pending, finite, wired)

    return init_fn, update_fn


def _pending_shape(shape) -> tuple:
    """A gradient's shape in the state: its own, ``(1,)`` for a scalar (under
    ``shard_map``, ``P(axis)`` stacks every device's along a first axis)."""
    return tuple(shape) or (1,)


def _as_pending(x):
    """``x`` as the state keeps it: a scalar as ``(1,)``, anything else as it is."""
    return x if jnp.ndim(x) else jnp.reshape(x, (1,))


def _check_pending(fn: str, updates, pending) -> None:
    """At trace time: each pending gradient has the shape ``init`` gives its leaf.

    A first axis the local device count times too small (or too large) is a
    state made (or passed) outside ``shard_map``'s per-device specs.
    """
    with_paths = jax.tree_util.tree_flatten_with_path(updates)[0]
    for (path, g), p in zip(with_paths, jax.tree_util.tree_leaves(pending)):
        want, got = _pending_shape(jnp.shape(g)), tuple(jnp.shape(p))
        if got == want:
            continue
        raise ValueError(
            f"{fn}: the pending gradient of {jax.tree_util.keystr(path) or 'the leaf'} "
            f"has shape {got}, the gradient needs {want} (double_buffering=True). Fix: "
            "make the state with init from parameters of the gradients' shapes; under "
            "shard_map make it inside the map, specs = jaxsync.state_specs(jax.eval_shape("
            "tx.init, params), axis_name); state = jax.jit(jax.shard_map(tx.init, "
            "mesh=mesh, in_specs=P(), out_specs=specs))(params), and pass it with specs."
        )


# docs/strategies.md's digits run (jaxsync.bench.digits: 4 replicas, Adam), 50 steps:
# test accuracy with double buffering against without it.
DOUBLE_BUFFERING_ACCURACY = "50 steps of digits reached 0.883 test accuracy, 0.900 without it"


def warn_no_inter_stage(fn, comm, overlap, double_buffering) -> None:
    """One ``UserWarning`` per factory call: ``overlap`` / ``double_buffering``
    without an inter-process stage hide no communication (the local axes' sums
    are XLA collectives of the step itself); double buffering still delays."""
    if comm is None:
        where = "comm=None: one process"
    elif isinstance(comm, str):
        where = f"comm={comm!r} found no MPI launch of several processes"
    else:
        where = "the communicator holds one process"
    parts = []
    if overlap:
        parts.append(
            "overlap=True overlaps the inter-process sums with the backward, and there "
            "are none here: it brings nothing and splits the local sums into more calls"
        )
    if double_buffering:
        parts.append(
            "double_buffering=True hides the inter-process sums behind the next step, "
            "and there are none here to hide, yet every update still applies the last "
            "step's gradients: a step of staleness, which costs accuracy on a short run "
            f"({DOUBLE_BUFFERING_ACCURACY}; see docs/strategies.md)"
        )
    names = " and ".join(
        name for name, on in (("overlap", overlap), ("double_buffering", double_buffering)) if on
    )
    warnings.warn(
        f"{fn}: no inter-process stage ({where}). {'; '.join(parts)}. Fix: drop {names}, "
        f"or turn {'them' if overlap and double_buffering else 'it'} on where the sync "
        "crosses processes (an MPI communicator of several processes, or jaxsync.AxisComm).",
        UserWarning,
        stacklevel=_outside_jaxsync(),
    )


def _outside_jaxsync() -> int:
    """The ``stacklevel`` of the first caller outside the jaxsync package (the
    line that called the factory), seen from the function that warns."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame: types.FrameType | None = sys._getframe(2)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def bad_type(fn, arg, expected, got, fix):
    """The TypeError of an option of the wrong type (``_config``'s too)."""
    msg = f"(expected: {expected}, got: {type(got).__name__} {got!r}). Fix: {fix}"
    return TypeError(f"{fn} got unexpected type for argument {arg!r} {msg}")


def check_overlap(fn, overlap, overlap_bucket_bytes, double_buffering) -> int:
    """Validate overlap, overlap_bucket_bytes and double_buffering; the bucket bytes."""
    if isinstance(overlap, str) and overlap != _AUTO:
        raise ValueError(
            f"{fn}: overlap must be one of (True, False, 'auto'), got {overlap!r}. Fix: "
            "overlap='auto' (default: on where the sync spans hosts), True or False."
        )
    for name, value, default in (
        ("overlap", overlap, "'auto'"),
        ("double_buffering", double_buffering, "False"),
    ):
        if not (isinstance(value, bool) or (name == "overlap" and isinstance(value, str))):
            raise bad_type(
                fn,
                name,
                "a bool" + (" or 'auto'" if name == "overlap" else ""),
                value,
                f"pass {name}=True or {name}=False (the default: {default})",
            )
    if isinstance(overlap_bucket_bytes, str) and overlap_bucket_bytes == _AUTO:
        return OVERLAP_BUCKET_BYTES
    if isinstance(overlap_bucket_bytes, bool) or not isinstance(
        overlap_bucket_bytes, (int, np.integer)
    ):
        raise bad_type(
            fn,
            "overlap_bucket_bytes",
            "a positive int or 'auto'",
            overlap_bucket_bytes,
            f"pass e.g. overlap_bucket_bytes={OVERLAP_BUCKET_BYTES} ('auto': 4 MiB)",
        )
    if overlap_bucket_bytes < 1:
        raise ValueError(
            f"{fn}: overlap_bucket_bytes must be >= 1, got {overlap_bucket_bytes}. "
            f"Fix: overlap_bucket_bytes='auto' ({OVERLAP_BUCKET_BYTES} bytes)."
        )
    if not overlap:
        raise ValueError(
            f"{fn}: overlap_bucket_bytes={overlap_bucket_bytes} sizes overlap's "
            "buckets, but overlap=False. Fix: pass overlap=True, or drop "
            "overlap_bucket_bytes."
        )
    return int(overlap_bucket_bytes)

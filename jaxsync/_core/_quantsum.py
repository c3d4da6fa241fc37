"""The quantized schedule (``comm_dtype=jaxsync.Quantized(...)``) and its state.

Wherever bytes cross the inter-process stage, each floating bucket is summed
as torchft's quantized all-reduce and ZeRO++'s qgZ do: quantized in blocks
(``_quant``), one all-to-all of the codes and scales (the reduce-scatter),
decoded and summed in float32 by the slice's owner, quantized again, one
all-gather. Inside a process (the local axes, a host's processes in the host
tier) the sum stays float32. Every bucket of a synchronisation travels in the
same two calls: its codes and float32 scales concatenated into one uint8 row
per peer, so the existing byte-moving calls carry them (jaxsync's native
``alltoall`` / ``allgather``, mpi4jax's, host staging, XLA's over a mesh axis).

Bytes per replica for ``n`` values, ``N`` processes, ``b`` bits, block ``B``:
``2 (N - 1) / N * n * (b / 8 + 4 / B)`` (where ``n / N`` is a multiple of ``B``;
each peer's slice otherwise rounds up to whole blocks).

``sharded`` takes the first half only (:func:`scatter_program`): its replicas'
rows all-to-all'd and summed by their owner, nothing requantized or gathered.

Error feedback: the first quantization's error (of this process's sum) is kept
in :class:`QuantState` and added to the next step's buffer before it is
quantized; the requantization of the summed slices is not covered.

With ``overlap`` / ``double_buffering`` the schedule runs per overlap bucket
(``_overlap.run_async``), its two calls on the communicator's thread.

May import: ``_quant``, ``_strategies``, ``_overlap``, ``_intra`` and the host
tier's module (``_sync`` imports it).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxsync._comm import _axis_backend

from . import _overlap, _strategies
from ._plan import make_plan
from ._quant import Quantized, decode, encode
from ._reduce16 import rows_sum_f32

_SEED = 0x5155  # the stochastic rounding's base key (fold_in: step, bucket, rank, stage)


class QuantState(NamedTuple):
    """State of a transform made with ``comm_dtype=jaxsync.Quantized(...)``.

    Attributes:
      step: steps taken (the stochastic rounding's keys fold it in).
      residual: per quantized bucket (float32, its length), the error of the
        last step's first quantization, added to the next step's buffer (zeros
        with ``error_feedback=False``); equal on the devices of a process.
        Checkpoint it with the optimizer state.
      all_finite: as :class:`jaxsync.SyncState` (``True`` without ``check_finite``).
    """

    step: jax.Array
    residual: tuple
    all_finite: jax.Array

    def jaxsync_state_specs(self, per_replica, replicated):
        """The ``PartitionSpec``s of this state (for :func:`jaxsync.state_specs`):
        the residuals per replica (their devices' copies stacked), the rest
        replicated."""
        return QuantState(replicated, tuple(per_replica for _ in self.residual), replicated)


def quantized_buckets(plan) -> list:
    """Indices of the buckets that travel quantized: the floating ones up to 32 bits."""
    return [
        k
        for k, b in enumerate(plan.buckets)
        if str(jnp.dtype(b.dtype)) in ("float32", "bfloat16", "float16")
    ]


def plan_for(tree, cfg):
    """The packing plan a quantized sync uses (buckets packed even with one
    device per process: a leaf per buffer would pay a partial block each)."""
    return make_plan(
        tree,
        bucket_bytes=cfg.bucket_bytes,
        pack_threshold=cfg.pack_threshold,
        per_leaf=cfg.strategy == "naive",
    )


def init_residual(tree, cfg) -> tuple:
    plan = plan_for(tree, cfg)
    return tuple(jnp.zeros((plan.buckets[k].size,), jnp.float32) for k in quantized_buckets(plan))


def _chunk(n: int, size: int, spec: Quantized) -> int:
    """Values of each peer's slice: ``ceil(n / size)``, even for 4 bits."""
    m = -(-n // size)
    return m + (m % 2 if spec.bits == 4 else 0)


def _pack_rows(parts) -> jax.Array:
    """``[(codes (r, c), scales (r, s))]`` -> one uint8 ``(r, sum(c + 4 s))``."""
    cols = []
    for codes, scales in parts:
        cols.append(codes)
        cols.append(lax.bitcast_convert_type(scales, jnp.uint8).reshape(scales.shape[0], -1))
    return jnp.concatenate(cols, axis=1) if len(cols) > 1 else cols[0]


def _unpack_rows(rows, sizes, spec: Quantized) -> list:
    """Inverse of :func:`_pack_rows`: the decoded ``(r, m)`` float32 per buffer."""
    out, off = [], 0
    r = rows.shape[0]
    for m in sizes:
        c = m * spec.bits // 8
        s = -(-m // spec.block) if m else 0
        codes = rows[:, off : off + c]
        off += c
        scales = lax.bitcast_convert_type(rows[:, off : off + 4 * s].reshape(r, s, 4), jnp.float32)
        off += 4 * s
        out.append(decode(codes, scales.reshape(r, s), m, spec))
    return out


def _key(spec: Quantized, step, k: int, rank, stage: int):
    """Stochastic rounding's key of buffer ``k`` at ``stage`` (0: the rows, 1: the
    sums requantized, 2: ``sharded``'s scatter) on ``rank`` at ``step``; None
    when the rounding is nearest."""
    if spec.rounding != "stochastic":
        return None
    key = jax.random.fold_in(jax.random.PRNGKey(_SEED), step)
    return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, k), rank), stage)


def _first_half(spec: Quantized, ops, bufs, count: int, rows_of, key_of):
    """Both schedules' first half. ``bufs``: ``count`` float32 buffers, then their
    residuals (``count`` more, or none). Each buffer (its residual added) is cut
    into one row per peer by ``rows_of(p, size) -> (m, rows)`` and quantized with
    ``key_of(k)``; one all-to-all carries every buffer's rows. Returns ``(xs,
    res, None)`` when nothing crosses (one peer, or no buffers), else ``(xs, res,
    (got, sizes, firsts))``: the ``(size, L)`` rows this peer got (peer ``i``'s
    rows of its slice), the rows' widths ``m``, and per buffer ``(p, codes,
    scales)`` (its new residual is their quantization error)."""
    xs, res = list(bufs[:count]), list(bufs[count:])
    size = ops.size
    if size == 1 or not xs:
        return xs, res, None
    parts, sizes, firsts = [], [], []
    for k, x in enumerate(xs):
        p = x + res[k] if res else x
        m, rows = rows_of(p, size)
        codes, scales = encode(rows, spec, key_of(k))
        sizes.append(m)
        parts.append((codes, scales))
        firsts.append((p, codes, scales))
    return xs, res, (ops.alltoall(_pack_rows(parts)), sizes, firsts)


def _finite_or_zero(e):
    """A new residual with its non-finite values zeroed: never poisoned."""
    return jnp.where(jnp.isfinite(e), e, jnp.zeros_like(e))


def program(spec: Quantized, count: int, step, rank, ks=None):
    """``prog(ops, bufs)``: ``bufs`` = ``count`` float32 buffers, then their
    residuals (``count`` more, or none); returns the sums, then the new residuals.
    ``step``, ``rank``: traced int32 (the stochastic keys), or None (nearest);
    ``ks``: the buffers' places among the sync's quantized buckets (the keys
    fold them in; default ``0 .. count - 1``)."""

    def keys(k, stage):
        return _key(spec, step, ks[k] if ks is not None else k, rank, stage)

    def rows_of(p, size):  # peer i's slice in row i, padded to m values
        n = p.shape[0]
        m = _chunk(n, size, spec)
        return m, jnp.pad(p, (0, m * size - n)).reshape(size, m)

    def prog(ops, bufs):
        xs, res, sent = _first_half(spec, ops, bufs, count, rows_of, lambda k: keys(k, 0))
        if sent is None:  # nothing crosses: the sums are the buffers
            return xs + res
        got, sizes, firsts = sent
        mine = [rows_sum_f32(v) for v in _unpack_rows(got, sizes, spec)]
        again = [encode(s[None], spec, keys(k, 1)) for k, s in enumerate(mine)]
        full = ops.allgather(_pack_rows(again).reshape(-1))  # (size, L)
        outs = [v.reshape(-1)[: x.shape[0]] for v, x in zip(_unpack_rows(full, sizes, spec), xs)]
        if not res:
            return outs
        new = []
        for (p, codes, scales), m in zip(firsts, sizes):
            e = p - decode(codes, scales, m, spec).reshape(-1)[: p.shape[0]]
            new.append(_finite_or_zero(e))
        return outs + new

    prog.reduced = count  # type: ignore[attr-defined]  # the host tier sums these only
    return prog


def scatter_program(spec: Quantized, count: int, step, rank):
    """``prog(ops, bufs)``: the schedule's first half, for ``sharded``'s
    reduce-scatter. ``bufs``: ``count`` float32 buffers of ``ops.size * K``
    values (row ``p``: peer ``p``'s slice), then their residuals (``count``
    more, or none). Each row is quantized (the residual added first), one
    all-to-all carries every buffer's codes and scales, and this peer decodes
    the rows of its slice and sums them in float32, in row order: it returns the
    ``(K,)`` sums, then the new residuals (the quantization's error). Nothing is
    requantized or gathered. ``step``, ``rank``: traced int32 (the stochastic
    keys: this replica's), or None (nearest)."""

    def rows_of(p, size):  # peer i's slice in row i, 4 bits: padded to even rows
        width = p.shape[0] // size
        m = width + (width % 2 if spec.bits == 4 else 0)
        return m, jnp.pad(p.reshape(size, width), ((0, 0), (0, m - width)))

    def key_of(k):
        return _key(spec, step, k, rank, 2)

    def prog(ops, bufs):
        xs, res, sent = _first_half(spec, ops, bufs, count, rows_of, key_of)
        if sent is None:  # nothing crosses: the buffers are the slices
            return xs + res
        got, sizes, firsts = sent
        widths = [p.shape[0] // ops.size for p, _, _ in firsts]
        sums = [rows_sum_f32(v)[:width] for v, width in zip(_unpack_rows(got, sizes, spec), widths)]
        if not res:
            return sums
        new = []
        for (p, codes, scales), m, width in zip(firsts, sizes, widths):
            e = p - decode(codes, scales, m, spec)[:, :width].reshape(-1)
            new.append(_finite_or_zero(e))
        return sums + new

    return prog


def _intra_index(intra):
    return lax.axis_index(intra.axes) if intra.axes else jnp.int32(0)


def _rank(backend, intra, per_device: bool):
    """The stochastic keys' rank: this process's (its devices quantize the same
    sum), or with ``per_device`` (each device its slice) this replica's."""
    proc: Any
    if isinstance(backend, _axis_backend.AxisBackend):
        proc = lax.axis_index(backend.axis)
    elif isinstance(backend, _axis_backend.LocalBackend):
        proc = 0
    else:
        proc = backend.comm.Get_rank()
    if not per_device:
        return jnp.int32(proc)
    return (jnp.int32(proc) * jnp.int32(intra.size) + _intra_index(intra)).astype(jnp.int32)


def run(cfg, bufs: list, res, intra, tiered: bool, step) -> tuple[list, tuple]:
    """Sum ``bufs`` over every replica, the floating buckets quantized across
    processes; ``res``: the residuals of those buckets (or None). Returns the
    sums and the new residuals (``res`` as given where nothing crossed).

    With ``overlap`` (or ``double_buffering``) the schedule runs once per
    overlap bucket, its all-to-all and all-gather on the communicator's thread
    (``_overlap.run_async``): the same bits as one call for every bucket."""
    if not (cfg.overlap or cfg.double_buffering):
        return _run(cfg, bufs, res, intra, tiered, step)
    qidx = [k for k, b in enumerate(bufs) if str(b.dtype) == "float32"]
    ef = res is not None and cfg.quant.error_feedback
    news = list(res) if ef else []

    def runner(idx, mine):
        ks = [qidx.index(i) for i in idx if i in qidx]
        got, new = _run(
            cfg, mine, tuple(news[k] for k in ks) if ef else None, intra, tiered, step, ks
        )
        for k, r in zip(ks, new if ef else ()):
            news[k] = r
        return got

    out = _overlap.run_async(cfg, bufs, intra, None, tiered, runner=runner)
    return out, (tuple(news) if ef else res)


def _run(cfg, bufs: list, res, intra, tiered: bool, step, ks=None) -> tuple[list, tuple]:
    spec: Quantized = cfg.quant
    qidx = [k for k, b in enumerate(bufs) if str(b.dtype) == "float32"]
    rest = [k for k in range(len(bufs)) if k not in qidx]
    out = list(bufs)
    if rest:
        for k, y in zip(
            rest, _strategies.run(cfg.strategy, [bufs[k] for k in rest], intra, cfg.backend)
        ):
            out[k] = y
    ef = res is not None and spec.error_feedback
    xs = [bufs[k] for k in qidx]
    if cfg.strategy == "single_node" or not xs:
        if not xs:
            return out, res
        for k, y in zip(qidx, _strategies.sum_buffers(intra, xs)):
            out[k] = y
        return out, res
    rs = list(res) if ef else []
    step = jnp.int32(0) if step is None else step
    two_d = cfg.strategy == "two_dimensional"
    rank = _rank(cfg.backend, intra, two_d) if spec.rounding == "stochastic" else None
    prog = program(spec, len(xs), step, rank, ks)
    if two_d:
        d = intra.size
        padded = [_strategies._pad_to(x, d) for x in xs]
        slices = [_strategies._scatter_sum(intra, x) for x, _ in padded]
        idx = _intra_index(intra)
        rsl = [
            lax.dynamic_index_in_dim(_strategies._pad_to(r, d)[0].reshape(d, -1), idx, 0, False)
            for r in rs
        ]
        got = cfg.backend.run(prog, slices + rsl, intra, leader_only=False)
        sums = [intra.allgather_tiled(s)[:n] for s, (_, n) in zip(got[: len(xs)], padded)]
        news = [intra.allgather_tiled(s)[: r.shape[0]] for s, r in zip(got[len(xs) :], rs)]
    else:  # naive, flat, hierarchical: the process's float32 sum, then its leader
        summed = _strategies.sum_buffers(intra, xs)
        got = cfg.backend.run(prog, summed + rs, intra, leader_only=True, tiered=tiered)
        sums, news = list(got[: len(xs)]), list(got[len(xs) :])
    for k, y in zip(qidx, sums):
        out[k] = y
    return out, (tuple(news) if ef else res)


def travel(dt):
    """The dtype a bucket of ``dt`` is quantized from: float32 for floating
    buckets of up to 32 bits; others travel as they are."""
    dt = jnp.dtype(dt)
    return jnp.dtype(jnp.float32) if jnp.issubdtype(dt, jnp.floating) and dt.itemsize <= 4 else dt


def check_stateless(cfg) -> None:
    """``sync_gradients`` keeps no state: error feedback and the stochastic
    rounding's step need a transform's."""
    q = cfg.quant
    if q is not None and (q.error_feedback or q.rounding == "stochastic"):
        raise ValueError(
            "sync_gradients: comm_dtype=Quantized(error_feedback="
            f"{q.error_feedback}, rounding={q.rounding!r}) needs a state (the residuals, "
            "the step for the stochastic keys), and sync_gradients keeps none. Fix: use "
            "a transform (e.g. jaxsync.hierarchical_mean(..., comm_dtype=...)), or pass "
            "Quantized(..., error_feedback=False, rounding='nearest')."
        )


def transform_fns(fn: str, cfg, sync):
    """``(init_fn, update_fn)`` of a transform whose wire is quantized."""

    def init_fn(params):
        return QuantState(jnp.zeros((), jnp.int32), init_residual(params, cfg), jnp.array(True))

    def update_fn(updates, state, params=None):
        del params
        if not isinstance(state, QuantState):
            raise TypeError(
                f"{fn}: update got a state of type {type(state).__name__}, expected "
                "QuantState from this transform's init (comm_dtype=Quantized(...)). "
                "Fix: call init first and pass the state it returned."
            )
        want = init_residual(updates, cfg)
        got = [tuple(r.shape) for r in state.residual]
        if got != [tuple(r.shape) for r in want]:
            raise ValueError(
                f"{fn}: the state's residuals have shapes {got}, this gradient tree's "
                f"quantized buckets {[tuple(r.shape) for r in want]}. Fix: init the "
                "state from parameters of the same tree (and the same bucket_bytes)."
            )
        synced, finite, res = sync(updates, cfg, quant=(state.residual, state.step))
        ok = finite if cfg.check_finite else state.all_finite
        return synced, QuantState(state.step + 1, tuple(res), ok)

    return init_fn, update_fn

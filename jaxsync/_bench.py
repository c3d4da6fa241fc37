"""Benchmark: jaxsync's strategies against the obvious ways to average gradients.

``python -m jaxsync bench`` measures, for a few gradient trees, the *marginal*
cost of a synchronisation inside a jitted training step::

    marginal = time(step with sync) - time(same step without sync)

where the step also does a cheap fake gradient computation on every leaf
(``g * 1.0001 + 1``), so the sync competes for memory bandwidth as it does in a
real step. Every case of a tree is timed once per round, rounds are repeated
and interleaved, and the marginal is taken per round against the base step of
the same round, so the ratios are measured side by side on a noisy machine.

Two modes:

* **intra** (one process, ``--devices`` fake CPU devices, default 8): inside
  ``jit(shard_map)`` over a 1-D mesh ``"d"``, jaxsync's strategies (``comm=None``)
  against per-leaf ``lax.pmean``, one ``lax.pmean`` of the whole tree and
  ``ravel_pytree`` + ``pmean``; the limit is ``psum`` of one preallocated f32
  buffer of the same bytes, in the same kind of step.
* **mpi** (under ``mpirun -n P``, ``--devices`` per process, default 1): the
  README's step, ``jit(shard_map)`` over the local devices with
  ``axis_name="local"`` and ``comm=MPI.COMM_WORLD`` (also ``comm_dtype=bfloat16``),
  and a whole train step (gradients, ``hierarchical_mean``, Adam) against the same
  step without the sync. With one device per process, the plain-``jit`` path
  (``axis_name=None``, rows ``(jit)``, also ``staging="host"``) and the peers run
  beside it: per-leaf ``mpi4jax.allreduce``, ``ravel_pytree`` + one
  ``mpi4jax.allreduce`` and per-leaf ``np.asarray`` + ``mpi4py`` ``Allreduce``.
  The limit is a bare ``mpi4py`` ``Allreduce`` of preallocated numpy buffers of the
  same bytes (a raw time, no step), out of place, with the in-place
  (``MPI.IN_PLACE``) one beside it; with several devices, ``psum bare`` is the
  intra-process limit. The row ``mpi4jax bare`` (one ``mpi4jax.allreduce`` of such
  a buffer inside a jitted step) tells the cost of MPI from the cost of calling it
  from XLA. mpi4jax and mpi4py have no bfloat16 type: those peers send 16-bit
  leaves as float32 (``ravel_pytree`` promotes them anyway). Every sample is the
  slowest rank's (a step is done when the slowest process is).

``hierarchical`` is the default strategy (``hierarchical_mean`` with default
options); ``hierarchical bf16`` adds ``comm_dtype=bfloat16``. On the ResNet-like
and 500-leaf trees, ``flat`` is also swept over ``bucket_bytes`` (with
``pack_threshold=None``) and ``pack_threshold``; configs that give the same
packing plan as one already measured are skipped (listed in the JSON).
Programs are compiled once per distinct HLO; cases sharing a program (same
``program`` hash in the JSON) are still timed separately, which shows the noise.

The device count must be set before JAX initialises its backends: ``main``
does it from ``--devices`` (``jax_num_cpu_devices``); when JAX is already
initialised (e.g. by the caller) with another count, it stops with an error
saying so (set ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` instead).

"Wire bytes" are modelled: what each replica sends under bandwidth-optimal
algorithms, counted from the step's jaxpr (allreduce ``2(p-1)/p·B``,
reduce-scatter and all-to-all ``(p-1)/p·B``, all-gather ``(p-1)·b``).

The host allocator is left as glibc sets it, as in a user's program;
``--tune-host-allocator`` calls ``jaxsync.tune_host_allocator()`` first (XLA
allocates a step's large buffers afresh on every call, and with glibc's defaults
their pages fault in again each time: the "faults" column). It applies to jaxsync
and the peers alike.

Results go to ``--out`` (default ``bench-results/``): ``<mode>.json``,
``<mode>.csv`` and ``<mode>.png``; a table and PASS/MISS lines for the targets
are printed. Only rank 0 prints or writes.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import json
import math
import os
import platform
import re
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

AXIS = "d"
LOCAL = "local"   # the local mesh axis under mpirun (the README's pattern)
KiB, MiB = 2**10, 2**20
SWEEP_TREES = ("resnet18", "small500", "mixed_tiny")
"""Trees on which the flat bucket_bytes / pack_threshold sweep runs."""

# Targets of the issues (evaluated and printed here, never asserted in tests).
LIMIT_MPI_VS_BARE = 1.0      # default (README's step, 1 device/process) vs out-of-place bare
LIMIT_MPI_VS_INPLACE = 1.4   # ... vs the in-place bare allreduce
LIMIT_MPI_SMALL = 4.0        # ... on 500 small leaves, vs bare
LIMIT_FLAT_2D = 1.25         # flat (ResNet-like) and two_dimensional vs bare
LIMIT_MULTI_DEVICE = 1.5     # several devices: vs bare allreduce + bare psum (or psum alone)
LIMIT_BF16_SPEEDUP = 1.7     # comm_dtype=bf16 at least this much faster than f32
LARGE_PARAMS = 10**6
STRATEGY_METHODS = ("naive", "flat", "hierarchical", "two_dimensional")
DEFAULT_METHOD = "hierarchical"


# --------------------------------------------------------------------------
# Trees (per-replica shapes)
# --------------------------------------------------------------------------

def _spec(shape, dtype="float32"):
    import jax
    import jax.numpy as jnp
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def resnet18_like() -> dict:
    """47 leaves, ~5.5M f32: a ResNet-18 with a two-conv stem, two blocks at 64
    channels and one block plus a 1x1 downsample at 128/256/512, each conv with
    BN scale/bias, and a 512x1000 classifier."""
    tree: dict = {}

    def conv(name, k, cin, cout):
        tree[name] = {"kernel": _spec((k, k, cin, cout)),
                      "bn": {"scale": _spec((cout,)), "bias": _spec((cout,))}}

    conv("stem1", 3, 3, 32)
    conv("stem2", 3, 32, 64)
    for b in range(2):
        conv(f"s64_b{b}_c1", 3, 64, 64)
        conv(f"s64_b{b}_c2", 3, 64, 64)
    cin = 64
    for c in (128, 256, 512):
        conv(f"s{c}_c1", 3, cin, c)
        conv(f"s{c}_c2", 3, c, c)
        conv(f"s{c}_down", 1, cin, c)
        cin = c
    tree["fc"] = {"kernel": _spec((512, 1000)), "bias": _spec((1000,))}
    return tree


def small_leaves(n: int = 500, size: int = 256) -> dict:
    """``n`` leaves of ``size`` float32 each."""
    return {f"p{i:03d}": _spec((size,)) for i in range(n)}


def transformer_like(layers: int = 6, d: int = 256, ff: int = 1024,
                     matrix_dtype: str = "float32", embed: int = 0) -> dict:
    """Attention qkv/out, MLP and two layer norms per layer, a final norm.

    Matrices are ``matrix_dtype``; biases and norms stay float32 (the usual
    mixed-precision layout). ``embed`` > 0 adds a float32 embedding table.
    """
    def dense(din, dout):
        return {"kernel": _spec((din, dout), matrix_dtype), "bias": _spec((dout,))}

    def norm():
        return {"scale": _spec((d,)), "bias": _spec((d,))}

    tree: dict = {f"layer{i}": {"qkv": dense(d, 3 * d), "out": dense(d, d),
                                "mlp_in": dense(d, ff), "mlp_out": dense(ff, d),
                                "ln1": norm(), "ln2": norm()} for i in range(layers)}
    tree["ln_f"] = norm()
    if embed:
        tree["embed"] = _spec((embed, d))
    return tree


def make_trees(quick: bool) -> dict[str, Callable[[], dict]]:
    if quick:  # one tiny tree with both dtypes: every method and sweep, fast to compile
        return {"mixed_tiny": lambda: transformer_like(2, 64, 256, "bfloat16", 300)}
    return {"resnet18": resnet18_like,
            "small500": small_leaves,
            "transformer": transformer_like,
            "mixed": lambda: transformer_like(4, 256, 1024, "bfloat16", 1000)}


def tree_info(tree) -> tuple[int, int, int]:
    """(leaves, params, bytes) of a tree of ShapeDtypeStructs."""
    import jax
    leaves = jax.tree.leaves(tree)
    params = sum(math.prod(l.shape) for l in leaves)
    nbytes = sum(math.prod(l.shape) * l.dtype.itemsize for l in leaves)
    return len(leaves), params, nbytes


# --------------------------------------------------------------------------
# Collectives of a step: arrays and modelled wire bytes (jaxpr), ops (HLO)
# --------------------------------------------------------------------------

_AXIS_KIND = {"psum": "allreduce", "psum_invariant": "allreduce", "pmax": "allreduce",
              "pmin": "allreduce", "reduce_scatter": "reduce_scatter",
              "all_gather": "allgather", "all_gather_invariant": "allgather",
              "all_to_all": "alltoall"}
_MPI_KIND = {"allreduce_mpi": "allreduce", "allgather_mpi": "allgather",
             "alltoall_mpi": "alltoall", "bcast_mpi": "bcast"}
_HOST_KIND = {"host_allreduce": "allreduce", "host_alltoall": "alltoall",
              "host_allgather": "allgather"}


def _wire(kind: str, nbytes: int, p: int) -> float:
    """Bytes one member sends for a collective whose local operand has nbytes."""
    if p <= 1:
        return 0.0
    return {"allreduce": 2 * (p - 1) / p * nbytes, "reduce_scatter": (p - 1) / p * nbytes,
            "alltoall": (p - 1) / p * nbytes, "allgather": (p - 1) * nbytes,
            "bcast": nbytes}[kind]


def _eqn_collective(eqn, axis_size: int, procs: int):
    """(kind, group size) of a collective equation, or None."""
    name = eqn.primitive.name
    if name in _AXIS_KIND:
        return _AXIS_KIND[name], axis_size
    if name in _MPI_KIND:
        return _MPI_KIND[name], procs
    if name == "jaxsync_mpi":
        return eqn.params["kind"], eqn.params["comm"].comm.Get_size()
    if name == "jaxsync_native":  # operands: token, comm, active, buffers...
        if eqn.params["kind"] == "agree":  # the agreement check: no data moves
            return None
        return eqn.params["kind"], eqn.params["size"]
    if name == "pure_callback":
        fn = getattr(eqn.params["callback"], "callback_func", None)
        kind = _HOST_KIND.get(getattr(fn, "__name__", ""))
        return (kind, procs) if kind else None
    return None


def collective_stats(jaxpr, axis_size: int, procs: int) -> tuple[int, float]:
    """(arrays handed to collectives, wire bytes) of one execution, from the
    jaxpr; of cond branches, the costliest is counted (only one runs)."""
    from jax._src import core
    arrays, wire = 0, 0.0
    for eqn in jaxpr.eqns:
        got = _eqn_collective(eqn, axis_size, procs)
        if got is not None:
            kind, p = got
            operands = eqn.invars[3:] if eqn.primitive.name == "jaxsync_native" else eqn.invars
            avals = [v.aval for v in operands if hasattr(v.aval, "dtype")]  # not tokens
            arrays += len(avals)
            wire += _wire(kind, sum(a.size * a.dtype.itemsize for a in avals), p)
        subs = [collective_stats(j, axis_size, procs) for j in core.jaxprs_in_params(eqn.params)]
        if eqn.primitive.name == "cond" and subs:
            subs = [max(subs, key=lambda s: s[1])]
        for a, w in subs:
            arrays += a
            wire += w
    return arrays, wire


_HLO_COLLECTIVE = re.compile(
    r"\s(all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)(-start)?\(|"
    r'custom_call_target="(mpi_\w+_ffi|jaxsync_\w+|xla_ffi_python_cpu_callback)"|'
    r"custom_call @(mpi_\w+_ffi|jaxsync_\w+|xla_ffi_python_cpu_callback)\(")


def hlo_collectives(hlo_text: str) -> int:
    """Collective instructions in compiled HLO (XLA may combine several arrays
    into one multi-operand all-reduce; MPI and host callbacks count one each).
    Also counts MPI custom calls in StableHLO text."""
    return sum(1 for line in hlo_text.splitlines() if _HLO_COLLECTIVE.search(line))


# --------------------------------------------------------------------------
# Cases, timing, statistics
# --------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    """One timed thing on one tree: a jitted step, or a host-side callable."""

    method: str
    kind: str                  # "base", "jaxsync", "peer", "bare", "limit", "sweep"
    base: str | None           # the case whose time is subtracted (None: raw time)
    step: Any = None           # a jitted step, compiled by compile_cases ...
    arg: Any = None            # ... and called on this argument
    run: Callable[[], Any] | None = None
    arrays: int = 0            # arrays handed to collectives (jaxpr)
    ops: int = 0               # collective instructions (compiled HLO)
    wire_bytes: float = 0.0
    compile_s: float = 0.0
    program: str = ""          # hash of the lowered program: equal hash, same program


def _compile(lowered):
    t0 = time.perf_counter()
    compiled = lowered.compile()
    return compiled, time.perf_counter() - t0


def compile_cases(cases: list[Case], axis_size: int, procs: int) -> None:
    """Trace every jitted step in order (under MPI, tracing is collective),
    count its collectives, and compile each distinct program once, in threads.

    Steps with ordered effects (mpi4jax's primitives) cannot be called through
    the ahead-of-time API: their first ``jit`` call compiles them, in order on
    every process, after the others.
    """
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    import jax
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        futures = {}
        for c in cases:
            if c.step is None:
                continue
            traced = c.step.trace(c.arg)
            c.arrays, c.wire_bytes = collective_stats(traced.jaxpr, axis_size, procs)
            lowered = traced.lower()
            text = lowered.as_text()
            c.program = hashlib.sha1(text.encode()).hexdigest()[:8]
            if traced.jaxpr.effects:
                c.ops = hlo_collectives(text)  # MPI custom calls are never combined
            elif c.program not in futures:
                futures[c.program] = pool.submit(_compile, lowered)
        for c in cases:
            if c.step is None:
                continue
            if c.program in futures:
                compiled, c.compile_s = futures[c.program].result()
                c.ops = hlo_collectives(compiled.as_text())
                c.run = functools.partial(compiled, c.arg)
            else:
                c.run = functools.partial(c.step, c.arg)
                t0 = time.perf_counter()
                jax.block_until_ready(c.run())
                c.compile_s = time.perf_counter() - t0


def time_calls(fn: Callable[[], Any], iters: int, barrier=None) -> tuple[float, float]:
    """Median seconds of ``iters`` calls of ``fn`` (each blocked until ready) and
    the minor page faults per call. ``barrier`` synchronises processes first."""
    import jax
    if barrier is not None:
        barrier()
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / iters
    return statistics.median(times), faults


@dataclasses.dataclass
class Row:
    """One result: the marginal cost of one method on one tree."""

    mode: str
    tree: str
    method: str
    kind: str
    leaves: int
    params: int
    tree_bytes: int
    wire_bytes: int
    arrays: int
    ops: int
    median_ms: float
    q25_ms: float
    q75_ms: float
    min_ms: float
    max_ms: float
    ratio_to_bare: float
    faults_per_call: float
    compile_s: float
    program: str
    iters: int
    correct: bool | None       # the result is the mean (None: not a mean)
    samples_ms: list[float]


def check_results(cases: list[Case]) -> dict[str, bool]:
    """Whether each method averaging the base tree's gradients gives their mean.

    Every replica computes the same gradients (from the same input), so the
    mean is each replica's own value: a wrong divisor, a lost or mixed-up leaf
    shows. Tolerance: a few ULP of the travelling dtype (bfloat16 for the
    ``bf16`` methods). Runs collectives: every process checks, in case order.
    """
    import jax
    bases = {c.method: jax.tree.map(np.asarray, jax.block_until_ready(c.run()))
             for c in cases if c.method in ("base tree", "base tree (jit)")}
    out = {}
    for c in cases:
        if c.base not in bases or c.kind == "base":
            continue
        want = bases[c.base]
        got = jax.tree.map(np.asarray, jax.block_until_ready(c.run()))
        ok = jax.tree.structure(got) == jax.tree.structure(want)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)) if ok else ():
            g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
            bits = 8 if "bf16" in c.method or str(w.dtype) == "bfloat16" else (
                11 if str(w.dtype) == "float16" else 24)
            ok = ok and g.shape == w.shape and bool(np.all(
                np.abs(g64 - w64) <= 4.0 * 2.0 ** -bits * np.abs(w64)))
        out[c.method] = ok
    return out


def make_rows(mode, tree_name, info, cases, iters, samples, faults,
              correct=None) -> list[Row]:
    """Marginal statistics per case; ``samples[r, i]``: round r, case i (seconds)."""
    index = {c.method: i for i, c in enumerate(cases)}
    samples = np.asarray(samples) * 1e3
    faults = np.median(np.asarray(faults), axis=0)

    def marginal(c):
        i, j = index[c.method], index.get(c.base)
        if j is None:
            return samples[:, i], faults[i]
        return samples[:, i] - samples[:, j], faults[i] - faults[j]

    bare = next(float(np.median(marginal(c)[0])) for c in cases if c.kind == "bare")
    leaves, params, nbytes = info
    rows = []
    for c in cases:
        if c.kind == "base":
            continue
        m, f = marginal(c)
        med = float(np.median(m))
        rows.append(Row(
            mode, tree_name, c.method, c.kind, leaves, params, nbytes, int(c.wire_bytes),
            c.arrays, c.ops, med, float(np.quantile(m, .25)), float(np.quantile(m, .75)),
            float(m.min()), float(m.max()), med / bare if bare > 0 else float("nan"),
            float(f), round(c.compile_s, 3), c.program, int(iters[index[c.method]]),
            (correct or {}).get(c.method), [round(float(x), 4) for x in m]))
    return rows


# --------------------------------------------------------------------------
# The step and its sync methods
# --------------------------------------------------------------------------

def fake_grads(tree):
    """Cheap per-leaf work standing in for the gradient computation."""
    import jax
    import jax.numpy as jnp
    return jax.tree.map(lambda x: x * jnp.asarray(1.0001, x.dtype) + jnp.asarray(1, x.dtype),
                        tree)


def _transform_sync(factory, **options):
    tx = factory(**options)

    def sync(g):
        return tx.update(g, tx.init(g))[0]
    return sync


def jaxsync_methods(axis_name, comm, mpi: bool, host: bool = False) -> dict[str, Callable]:
    """jaxsync's strategies as per-replica ``tree -> tree`` functions."""
    import jax.numpy as jnp
    import jaxsync
    common = dict(axis_name=axis_name, comm=comm)
    out = {"naive": _transform_sync(jaxsync.naive_mean, **common),
           "flat": _transform_sync(jaxsync.flat_mean, **common),
           # the default: hierarchical_mean with default options
           DEFAULT_METHOD: _transform_sync(jaxsync.hierarchical_mean, **common),
           "two_dimensional": _transform_sync(jaxsync.two_dimensional_mean, **common)}
    if host:
        out["flat host"] = _transform_sync(jaxsync.flat_mean, staging="host", **common)
    if not mpi:
        out["single_node"] = _transform_sync(jaxsync.single_node_mean, axis_name=axis_name)
    out[f"{DEFAULT_METHOD} bf16"] = _transform_sync(
        jaxsync.hierarchical_mean, comm_dtype=jnp.bfloat16, **common)
    return out


def _fmt_bytes(n):
    return "none" if n is None else (f"{n // MiB}MiB" if n >= MiB else f"{n // KiB}KiB")


def sweep_methods(tree, axis_name, comm) -> tuple[dict[str, Callable], dict[str, str]]:
    """flat with bucket_bytes swept at pack_threshold=None (everything packed) and
    pack_threshold swept at the default bucket_bytes.

    A config whose packing plan equals plain flat's, or an earlier config's, is
    the same program: it is skipped and reported as such. Returns
    ``(methods, skipped)`` with ``skipped[name]`` naming the equal one.
    """
    import jaxsync
    from ._config import make_config
    default = make_config("flat_mean", "flat", axis_name, None)
    configs = [(b, None) for b in (256 * KiB, 4 * MiB, 64 * MiB, None)]
    configs += [(64 * MiB, t) for t in (64 * KiB, 256 * KiB, 1 * MiB)]

    def plan(b, t):
        return jaxsync.make_plan(tree, bucket_bytes=b, pack_threshold=t).buckets

    seen = {plan(default.bucket_bytes, default.pack_threshold): "flat"}
    methods, skipped = {}, {}
    for b, t in configs:
        name = f"flat b={_fmt_bytes(b)} t={_fmt_bytes(t)}"
        key = plan(b, t)
        if key in seen:
            skipped[name] = seen[key]
            continue
        seen[key] = name
        methods[name] = _transform_sync(jaxsync.flat_mean, axis_name=axis_name, comm=comm,
                                        bucket_bytes=b, pack_threshold=t)
    return methods, skipped


# Peers inside one process (traced inside shard_map over AXIS).

def pmean_per_leaf(g):
    """One ``lax.pmean`` per leaf."""
    import jax
    from jax import lax
    return jax.tree.map(lambda x: lax.pmean(x, AXIS), g)


def pmean_tree(g):
    """One ``lax.pmean`` of the whole tree (XLA emits one multi-operand all-reduce)."""
    from jax import lax
    return lax.pmean(g, AXIS)


def ravel_pmean(g):
    """``ravel_pytree`` (promotes to one dtype), one ``pmean``, unravel."""
    from jax import lax
    from jax.flatten_util import ravel_pytree
    flat, unravel = ravel_pytree(g)
    return unravel(lax.pmean(flat, AXIS))


INTRA_PEERS = {"pmean/leaf": pmean_per_leaf, "pmean/tree": pmean_tree,
               "ravel+pmean": ravel_pmean}


# Peers across processes (plain jit, one device per process).

def _wide(x):
    """MPI has no 16-bit float type: send float16/bfloat16 as float32."""
    import jax.numpy as jnp
    return x.astype(jnp.float32) if x.dtype.itemsize == 2 else x


def mpi4jax_mean(x, comm):
    import mpi4jax
    from mpi4py import MPI
    y = mpi4jax.allreduce(_wide(x), op=MPI.SUM, comm=comm)
    return (y / comm.Get_size()).astype(x.dtype)


def mpi4jax_per_leaf(g, comm):
    """One ``mpi4jax.allreduce`` per leaf."""
    import jax
    return jax.tree.map(lambda x: mpi4jax_mean(x, comm), g)


def ravel_mpi4jax(g, comm):
    """``ravel_pytree`` + one ``mpi4jax.allreduce`` + unravel."""
    from jax.flatten_util import ravel_pytree
    flat, unravel = ravel_pytree(g)
    return unravel(mpi4jax_mean(flat, comm))


def mpi4py_host_per_leaf(g, comm):
    """Host staging by hand: ``np.asarray`` + ``comm.Allreduce`` per leaf, back
    to the device (runs outside jit, on the result of the step)."""
    import jax
    from mpi4py import MPI
    size = comm.Get_size()

    def one(x):
        a = np.asarray(x)
        a = a.astype(np.float32) if a.dtype.itemsize == 2 else a
        out = np.empty_like(a)
        comm.Allreduce(a, out, op=MPI.SUM)
        out /= size
        return jax.device_put(out.astype(x.dtype))
    return jax.tree.map(one, g)


# --------------------------------------------------------------------------
# Benches: the cases of one tree
# --------------------------------------------------------------------------

class _MeshBench:
    """Steps under ``jit(shard_map)`` over a 1-D mesh ``self.mesh`` of axis ``self.axis``."""

    axis: str
    mesh: Any
    n: int

    def _stacked(self, tree):
        """Per device, ones of the tree's shapes, stacked on a leading axis."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        sharding = NamedSharding(self.mesh, P(self.axis))
        make = jax.jit(lambda: jax.tree.map(
            lambda s: jnp.ones((self.n, *s.shape), s.dtype), tree), out_shardings=sharding)
        return jax.block_until_ready(make())

    def _mapped(self, body):
        import jax
        from jax.sharding import PartitionSpec as P
        return jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=P(self.axis),
                                     out_specs=P(self.axis)))

    def _step(self, sync):
        """The README's step: per device, fake gradients, then the sync."""
        import jax

        def body(stacked):
            g = fake_grads(jax.tree.map(lambda x: x[0], stacked))
            if sync is not None:
                g = sync(g)
            return jax.tree.map(lambda x: x[None], g)
        return self._mapped(body)


class IntraBench(_MeshBench):
    """One process, ``n`` devices, ``jit(shard_map)`` over the mesh axis ``"d"``."""

    mode = "intra"
    axis = AXIS

    def __init__(self, sweeps: bool):
        import jax
        from jax.sharding import Mesh
        self.mesh = Mesh(np.array(jax.devices()), (AXIS,))
        self.n = jax.device_count()
        self.methods = jaxsync_methods(AXIS, None, mpi=False)
        self.sweeps = sweeps
        self.rank, self.barrier, self.comm = 0, None, None

    def cases(self, tree, sweep: bool) -> tuple[list[Case], dict]:
        import jax
        import jax.numpy as jnp
        from jax import lax
        arg = self._stacked(tree)
        buf = self._stacked(jax.ShapeDtypeStruct((tree_info(tree)[2] // 4,), jnp.float32))
        sweeps, skipped = sweep_methods(tree, AXIS, None) if sweep else ({}, {})

        def case(method, kind, sync, base="base tree", x=arg):
            return Case(method, kind, base, step=self._step(sync), arg=x)

        cases = [case("base tree", "base", None, None),
                 case("base buffer", "base", None, None, buf),
                 *(case(m, "jaxsync", s) for m, s in self.methods.items()),
                 *(case(m, "peer", s) for m, s in INTRA_PEERS.items()),
                 case("psum bare", "bare", lambda b: lax.psum(b, AXIS), "base buffer", buf),
                 *(case(m, "sweep", s) for m, s in sweeps.items())]
        compile_cases(cases, self.n, 1)
        return cases, skipped


class MPIBench(_MeshBench):
    """Several processes under mpirun, ``devices`` devices each.

    The jaxsync rows run the way the README tells users to write their step:
    ``jit(shard_map)`` over a mesh of the local devices with ``axis_name="local"``
    (also when that axis has one device). With one device per process the plain
    ``jit`` path (``axis_name=None``, rows marked ``(jit)``) and the mpi4jax peers
    run beside it; mpi4jax's ordered effects refuse computations over several
    devices, so with more devices its rows are left out.
    """

    mode = "mpi"
    axis = LOCAL

    def __init__(self, comm, sweeps: bool, devices: int = 1):
        import jax
        from jax.sharding import Mesh
        self.comm = comm
        self.peer_comm = comm.Dup()
        self.rank, self.procs = comm.Get_rank(), comm.Get_size()
        self.barrier = comm.Barrier
        self.n = devices
        self.mesh = Mesh(np.array(jax.local_devices()[:devices]), (LOCAL,))
        self.methods = jaxsync_methods(LOCAL, comm, mpi=True)
        self.jit_methods = ({f"{m} (jit)": s for m, s in
                             jaxsync_methods(None, comm, mpi=True, host=True).items()}
                            if devices == 1 else {})
        self.sweeps = sweeps
        c = self.peer_comm
        self.jit_peers = ({"mpi4jax/leaf": lambda g: mpi4jax_per_leaf(g, c),
                           "ravel+mpi4jax": lambda g: ravel_mpi4jax(g, c)}
                          if devices == 1 else {})

    def _train_step(self, tree, sync_factory):
        """A whole step: gradients of a loss, the sync, Adam, the new parameters."""
        import jax
        import jax.numpy as jnp
        import optax
        tx = optax.adam(1e-3) if sync_factory is None else optax.chain(
            sync_factory(), optax.adam(1e-3))
        state0 = jax.eval_shape(tx.init, tree)

        def body(stacked):
            params = jax.tree.map(lambda x: x[0], stacked)
            state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), state0)

            def loss(p):
                return sum(jnp.vdot(x, x * jnp.asarray(0.5, x.dtype)).astype(jnp.float32)
                           for x in jax.tree.leaves(p))
            grads = jax.grad(loss)(params)
            updates, _ = tx.update(grads, state, params)
            return jax.tree.map(lambda x: x[None], optax.apply_updates(params, updates))
        return self._mapped(body)

    def cases(self, tree, sweep: bool) -> tuple[list[Case], dict]:
        import jax
        import jax.numpy as jnp
        from jax import lax
        from mpi4py import MPI
        import jaxsync
        arg = self._stacked(tree)
        nbytes = tree_info(tree)[2]
        buf = self._stacked(jax.ShapeDtypeStruct((nbytes // 4,), jnp.float32))
        sweeps, skipped = sweep_methods(tree, LOCAL, self.comm) if sweep else ({}, {})

        def case(method, kind, sync, base="base tree", x=arg):
            return Case(method, kind, base, step=self._step(sync), arg=x)

        def jit_case(method, kind, sync, base="base tree (jit)", x=None):
            x = jax.tree.map(lambda a: a[0], arg) if x is None else x
            step = jax.jit(lambda t: fake_grads(t) if sync is None else sync(fake_grads(t)))
            return Case(method, kind, base, step=step, arg=x)

        def mpi4jax_sum(b):
            import mpi4jax
            return mpi4jax.allreduce(b, op=MPI.SUM, comm=self.peer_comm)

        train = functools.partial(jaxsync.hierarchical_mean, axis_name=LOCAL, comm=self.comm)
        cases = [case("base tree", "base", None, None),
                 case("base buffer", "base", None, None, buf),
                 Case("train step (no sync)", "base", None, step=self._train_step(tree, None),
                      arg=arg),
                 *(case(m, "jaxsync", s) for m, s in self.methods.items()),
                 Case(f"{DEFAULT_METHOD} in a train step", "jaxsync", "train step (no sync)",
                      step=self._train_step(tree, train), arg=arg)]
        if self.n > 1:  # the intra stage alone, for "bare allreduce + bare psum"
            cases.append(case("psum bare", "limit", lambda b: lax.psum(b, LOCAL),
                              "base buffer", buf))
        if self.n == 1:
            cases += [jit_case("base tree (jit)", "base", None, None),
                      jit_case("base buffer (jit)", "base", None, None, buf[0]),
                      *(jit_case(m, "jaxsync", s) for m, s in self.jit_methods.items()),
                      *(jit_case(m, "peer", s) for m, s in self.jit_peers.items()),
                      # the bare collective inside a jitted step, to tell MPI's cost
                      # from the cost of calling it from XLA
                      jit_case("mpi4jax bare", "limit", mpi4jax_sum, "base buffer (jit)",
                               buf[0])]
        cases += [case(m, "sweep", s) for m, s in sweeps.items()]
        compile_cases(cases, self.n, self.procs)

        leaves = jax.tree.leaves(tree)
        extra = []
        if self.n == 1:
            base = next(c for c in cases if c.method == "base tree (jit)").run
            extra.append(Case(
                "mpi4py/leaf host", "peer", "base tree (jit)",
                run=lambda: mpi4py_host_per_leaf(base(), self.peer_comm),
                arrays=len(leaves), ops=len(leaves), wire_bytes=sum(
                    _wire("allreduce", math.prod(l.shape) * max(l.dtype.itemsize, 4),
                          self.procs) for l in leaves)))
        send = np.ones(nbytes // 4, np.float32)
        recv = np.ones_like(send)
        wire = _wire("allreduce", send.nbytes, self.procs)
        extra += [Case("mpi4py bare", "bare", None,
                       run=lambda: self.peer_comm.Allreduce(send, recv, op=MPI.SUM),
                       arrays=1, ops=1, wire_bytes=wire),
                  Case("mpi4py bare in-place", "limit", None,
                       run=lambda: self.peer_comm.Allreduce(MPI.IN_PLACE, recv, op=MPI.SUM),
                       arrays=1, ops=1, wire_bytes=wire)]
        k = next(i for i, c in enumerate(cases) if c.kind == "sweep") if sweeps else len(cases)
        return cases[:k] + extra + cases[k:], skipped


# --------------------------------------------------------------------------
# Running a tree
# --------------------------------------------------------------------------

def _log(bench, msg):
    if bench.rank == 0:
        print(f"[bench] {msg}", file=sys.stderr, flush=True)


def run_tree(bench, tree_name: str, tree, repeats: int, min_sample_s: float,
             max_iters: int) -> tuple[list[Row], dict]:
    """Compile, warm up, calibrate and time every case of one tree, interleaved."""
    info = tree_info(tree)
    _log(bench, f"{tree_name}: {info[0]} leaves, {info[1] / 1e6:.2f}M params, "
                f"{info[2] / MiB:.1f} MiB; compiling")
    t0 = time.perf_counter()
    cases, skipped = bench.cases(tree, bench.sweeps and tree_name in SWEEP_TREES)
    t1 = time.perf_counter()
    correct = check_results(cases)
    # Warm up (first runs, allocator) and calibrate: a sample is the median of
    # enough calls to last about min_sample_s; every process uses the same counts.
    warm = np.array([time_calls(c.run, 2, bench.barrier)[0] for c in cases])
    if bench.comm is not None:
        from mpi4py import MPI
        bench.comm.Allreduce(MPI.IN_PLACE, warm, op=MPI.MAX)
    iters = np.clip(np.ceil(min_sample_s / np.maximum(warm, 1e-6)), 1, max_iters).astype(int)
    _log(bench, f"{tree_name}: {len(cases)} cases ({len({c.program for c in cases})} "
                f"programs) compiled in {t1 - t0:.0f} s; timing {repeats} rounds")
    samples = np.zeros((repeats, len(cases)))
    faults = np.zeros((repeats, len(cases)))
    for r in range(repeats):
        k = r % len(cases)  # rotate the order so no case always follows the same one
        for i in [*range(k, len(cases)), *range(k)]:
            samples[r, i], faults[r, i] = time_calls(cases[i].run, iters[i], bench.barrier)
    if bench.comm is not None:  # a step is done when the slowest process is
        from mpi4py import MPI
        bench.comm.Allreduce(MPI.IN_PLACE, samples, op=MPI.MAX)
    return make_rows(bench.mode, tree_name, info, cases, iters, samples, faults,
                     correct), skipped


# --------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------

@dataclasses.dataclass
class Target:
    name: str
    tree: str
    ratio: float
    limit: str
    passed: bool | None     # None: not applicable / not measurable
    note: str = ""


def _overlap(a: Row, b: Row) -> bool:
    return a.q25_ms <= b.q75_ms and b.q25_ms <= a.q75_ms


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def evaluate_targets(rows: list[Row], devices: int = 1) -> list[Target]:
    """The issues' targets, per tree, measured side by side in one run.

    * the default no slower than the best peer, and every strategy no slower than
      the per-leaf mpi4jax loop (median marginal costs);
    * under MPI with one device per process (the README's shard_map step): the
      default <= 1.0x the out-of-place bare allreduce and <= 1.4x the in-place one
      on trees of >= 1M parameters, <= 4x on 500 small leaves; ``flat`` <= 1.25x on
      the ResNet-like tree and ``two_dimensional`` <= 1.25x on trees of >= 1M;
    * with several devices per process: the default <= 1.5x (bare allreduce + bare
      psum) under MPI, <= 1.5x the bare psum in one process (trees of >= 1M);
    * ``comm_dtype=bfloat16`` >= 1.7x faster than float32 where it sends fewer
      bytes (float32 trees of >= 1M parameters).

    A ratio that noise makes meaningless (a median <= 0) gives ``passed=None``.
    """
    out = []
    by_tree: dict[str, dict[str, Row]] = {}
    for r in rows:
        by_tree.setdefault(r.tree, {})[r.method] = r

    def target(name, tree, ratio, limit, note=""):
        out.append(Target(name, tree, ratio, f"<= {limit:.2f}",
                          _check(ratio, lambda x: x <= limit), note))

    for tree, rs in by_tree.items():
        d = rs[DEFAULT_METHOD]
        mode = d.mode
        large = d.params >= LARGE_PARAMS
        small = d.leaves >= 500 and d.tree_bytes / d.leaves <= 4 * KiB
        peers = [r for r in rs.values() if r.kind == "peer"]
        if peers:
            best = min(peers, key=lambda r: r.median_ms)
            note = f"best peer {best.method}"
            if _overlap(d, best):
                note += "; IQRs overlap (within noise)"
            target("default no slower than best peer", tree,
                   _ratio(d.median_ms, best.median_ms), 1.0, note)
        loop = rs.get("mpi4jax/leaf")
        if loop is not None:
            for m in STRATEGY_METHODS:
                for name in (m, f"{m} (jit)"):
                    if name in rs:
                        target(f"{name} no slower than the mpi4jax loop", tree,
                               _ratio(rs[name].median_ms, loop.median_ms), 1.0)
        bare = d.median_ms / d.ratio_to_bare if d.ratio_to_bare else float("nan")
        if mode == "mpi" and devices == 1:
            inplace = rs.get("mpi4py bare in-place")
            if large:
                target("default vs bare allreduce", tree, d.ratio_to_bare, LIMIT_MPI_VS_BARE)
                if inplace is not None:
                    target("default vs in-place bare allreduce", tree,
                           _ratio(d.median_ms, inplace.median_ms), LIMIT_MPI_VS_INPLACE)
                if "two_dimensional" in rs:
                    target("two_dimensional vs bare", tree,
                           rs["two_dimensional"].ratio_to_bare, LIMIT_FLAT_2D)
                if tree.startswith("resnet") and "flat" in rs:
                    target("flat vs bare", tree, rs["flat"].ratio_to_bare, LIMIT_FLAT_2D)
            if small:
                target(f"default vs bare, {d.leaves} small leaves", tree, d.ratio_to_bare,
                       LIMIT_MPI_SMALL)
        elif mode == "mpi" and large and "psum bare" in rs:
            both = bare + rs["psum bare"].median_ms
            target("default vs bare allreduce + bare psum", tree,
                   _ratio(d.median_ms, both), LIMIT_MULTI_DEVICE)
        elif mode == "intra" and large:
            target("default vs bare psum", tree, d.ratio_to_bare, LIMIT_MULTI_DEVICE)
        low = rs.get(f"{DEFAULT_METHOD} bf16")
        all_f32 = d.tree_bytes == 4 * d.params
        if low is not None and large and all_f32:
            speed = _ratio(d.median_ms, low.median_ms)
            note = f"wire {d.wire_bytes / MiB:.1f} -> {low.wire_bytes / MiB:.1f} MiB"
            narrower = low.wire_bytes < d.wire_bytes
            if not narrower:
                note += "; not narrower on the wire here, so not applicable"
            out.append(Target(f"bf16 comm >= {LIMIT_BF16_SPEEDUP}x faster than f32", tree,
                              speed, f">= {LIMIT_BF16_SPEEDUP:.2f}",
                              _check(speed, lambda x: x >= LIMIT_BF16_SPEEDUP)
                              if narrower else None, note))
    return out


def _check(x, ok):
    return bool(ok(x)) if math.isfinite(x) else None


# --------------------------------------------------------------------------
# Output: table, files, plot
# --------------------------------------------------------------------------

def print_report(rows: list[Row], targets: list[Target], meta: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    console = Console()
    if not console.is_terminal:
        console = Console(width=132)
    table = Table(title=f"jaxsync bench, {meta['mode']}: {meta['devices']} device(s) x "
                        f"{meta['processes']} process(es); marginal cost of the sync "
                        f"inside a jitted step, median over {meta['repeats']} rounds")
    for col in ("tree", "method", "ms", "IQR ms", "x bare", "wire MiB", "arrays", "ops",
                "faults", "compile s"):
        table.add_column(col, justify="left" if col in ("tree", "method") else "right")
    last = None
    for r in rows:
        if last is not None and r.tree != last:
            table.add_section()
        style = {"bare": "dim", "limit": "dim", "peer": "cyan", "sweep": "magenta"}.get(
            r.kind, "")
        if r.method == DEFAULT_METHOD:
            style = "bold"
        table.add_row(r.tree if r.tree != last else "", r.method, f"{r.median_ms:.3f}",
                      f"{r.q25_ms:.2f}..{r.q75_ms:.2f}", f"{r.ratio_to_bare:.2f}",
                      f"{r.wire_bytes / MiB:.2f}", str(r.arrays), str(r.ops),
                      f"{r.faults_per_call:.0f}", f"{r.compile_s:.2f}", style=style)
        last = r.tree
    console.print(table)
    console.print("[dim]ms: marginal cost (step with sync - step without); x bare: ratio of "
                  "medians to the bare collective of the same bytes; wire: modelled bytes "
                  "sent per replica; arrays: arrays handed to collectives; ops: collective "
                  "instructions after XLA; faults: extra minor page faults per call. "
                  f"{'Host allocator tuned. ' if meta['tune_host_allocator'] else ''}"
                  f"{meta['seconds']} s, load average {meta['loadavg_start'][0]:.1f} -> "
                  f"{meta['loadavg_end'][0]:.1f}.[/dim]")
    for t in targets:
        tag = {True: "[green]PASS[/green]", False: "[red]MISS[/red]",
               None: "[yellow]N/A [/yellow]"}[t.passed]
        console.print(f"{tag} {escape(t.name)} ({t.tree}): {t.ratio:.2f} (target "
                      f"{t.limit})" + (f"  {escape(t.note)}" if t.note else ""))


def write_files(rows: list[Row], targets: list[Target], meta: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    stem = out / meta["mode"]
    paths = [stem.with_suffix(".json"), stem.with_suffix(".csv"), stem.with_suffix(".png")]
    paths[0].write_text(json.dumps(
        {"meta": meta, "rows": [dataclasses.asdict(r) for r in rows],
         "targets": [dataclasses.asdict(t) for t in targets]}, indent=1))
    fields = [f.name for f in dataclasses.fields(Row) if f.name != "samples_ms"]
    with open(paths[1], "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(dataclasses.asdict(r))
    plot(rows, meta, paths[2])
    return paths


def plot(rows: list[Row], meta: dict, path: Path) -> None:
    """Grouped bars of the marginal cost, methods per tree (log scale); the flat
    sweep in a second panel, next to flat, hierarchical and the bare collective."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    swept = {r.tree for r in rows if r.kind == "sweep"}
    panels = [[r for r in rows if r.kind != "sweep"]]
    if swept:
        panels.append([r for r in rows if r.tree in swept and (
            r.kind in ("sweep", "bare") or r.method in ("flat", DEFAULT_METHOD))])
    fig, axes = plt.subplots(len(panels), 1, figsize=(15, 5 * len(panels)), squeeze=False)
    cmap = plt.get_cmap("tab20")
    for ax, prow in zip(axes[:, 0], panels):
        trees = list(dict.fromkeys(r.tree for r in prow))
        methods = list(dict.fromkeys(r.method for r in prow))
        positive = [r.median_ms for r in prow if r.median_ms > 0] or [1.0]
        floor = min(positive) / 4  # medians <= 0 (below noise) are drawn at the floor
        by_tree = {t: {r.method: r for r in prow if r.tree == t} for t in trees}
        width = 0.85 / max(len(b) for b in by_tree.values())
        for j, m in enumerate(methods):
            xs, ys, lo, hi = [], [], [], []
            for i, t in enumerate(trees):
                r = by_tree[t].get(m)
                if r is None:
                    continue
                k, n = list(by_tree[t]).index(m), len(by_tree[t])  # centred per tree
                y = max(r.median_ms, floor)
                xs.append(i + (k - (n - 1) / 2) * width)
                ys.append(y)
                lo.append(y - min(max(r.q25_ms, floor), y))
                hi.append(max(r.q75_ms - y, 0))
            ax.bar(xs, ys, width, yerr=[lo, hi], label=m, color=cmap(j % 20), capsize=2,
                   edgecolor="black" if m == DEFAULT_METHOD else "none")
        ax.set_xticks(range(len(trees)), trees)
        ax.set_yscale("log")
        ax.set_ylim(bottom=floor)
        ax.set_ylabel("marginal ms per step (log)")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].set_title(f"jaxsync bench ({meta['mode']}: {meta['devices']} device(s) x "
                         f"{meta['processes']} process(es)); bars: median, whiskers: IQR; "
                         "black edge: the default")
    if swept:
        axes[1, 0].set_title("flat swept over bucket_bytes (b) and pack_threshold (t)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------

def _mpi_world():
    """``MPI.COMM_WORLD`` when started by an MPI launcher with several processes."""
    from ._topology import launched_by_mpi
    if not launched_by_mpi():
        return None
    from mpi4py import MPI
    return MPI.COMM_WORLD if MPI.COMM_WORLD.Get_size() > 1 else None


def _set_devices(n: int) -> None:
    """Ask for ``n`` CPU devices; must happen before JAX initialises its backends."""
    import jax
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        if jax.local_device_count() != n:
            raise SystemExit(
                f"jaxsync bench: JAX is already initialised with {jax.local_device_count()} "
                f"device(s), --devices asks for {n}. Start a fresh process, or set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before JAX starts.")


def _parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jaxsync bench",
        description="Marginal cost of gradient synchronisation inside a jitted step: "
                    "jaxsync's strategies against peers and the bare collective. Run "
                    "plainly for one process with fake CPU devices, or under "
                    "`mpirun -n 2` for the inter-process benchmark.")
    p.add_argument("--devices", type=int, default=None,
                   help="CPU devices per process (default: 8 in one process, 1 under mpirun; "
                        "set before JAX starts). Under mpirun they form the local axis of "
                        "the README's shard_map step")
    p.add_argument("--repeats", type=int, default=None,
                   help="interleaved rounds per tree (default 5, --quick 2)")
    p.add_argument("--min-sample-ms", type=float, default=None,
                   help="a sample is the median of enough calls to last about this long "
                        "(default 50, --quick 5)")
    p.add_argument("--trees", nargs="+", default=None,
                   help="subset of trees (default: resnet18 small500 transformer mixed)")
    p.add_argument("--tune-host-allocator", action="store_true",
                   help="call jaxsync.tune_host_allocator() first (glibc keeps large buffers "
                        "for reuse instead of page-faulting fresh ones in on every call), "
                        "for jaxsync and the peers alike. Default: glibc's defaults, as a "
                        "user's program has them; run both ways to see the difference")
    p.add_argument("--no-sweeps", action="store_true",
                   help="skip the flat bucket_bytes / pack_threshold sweep")
    p.add_argument("--quick", action="store_true",
                   help="one tiny tree and 2 rounds (about 20 s; a smoke test, not a "
                        "measurement)")
    p.add_argument("--out", type=Path, default=Path("bench-results"),
                   help="directory for <mode>.json, .csv and .png (default bench-results/)")
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 2 if args.quick else 5
    if args.min_sample_ms is None:
        args.min_sample_ms = 5.0 if args.quick else 50.0
    if args.repeats < 1 or args.min_sample_ms < 0 or (
            args.devices is not None and args.devices < 1):
        p.error("--repeats and --devices must be positive, --min-sample-ms >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """``python -m jaxsync bench [options]``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[0] == "--suite":  # another suite: jaxsync/_bench_<name>.py
        import importlib
        try:
            suite = importlib.import_module(f"jaxsync._bench_{argv[1]}")
        except ModuleNotFoundError as e:
            if e.name != f"jaxsync._bench_{argv[1]}":
                raise
            raise SystemExit(f"jaxsync bench: unknown suite {argv[1]!r} (no module "
                             f"jaxsync/_bench_{argv[1]}.py)") from None
        return suite.main(argv[2:])
    args = _parse(argv)
    comm = _mpi_world()
    devices = args.devices or (1 if comm is not None else 8)
    _set_devices(devices)
    if args.tune_host_allocator:
        import jaxsync
        tuned = jaxsync.tune_host_allocator()
    else:
        tuned = False

    import jax
    trees = make_trees(args.quick)
    names = args.trees or list(trees)
    unknown = [n for n in names if n not in trees]
    if unknown:
        raise SystemExit(f"jaxsync bench: unknown tree(s) {unknown}; choose from {list(trees)}")
    bench = MPIBench(comm, not args.no_sweeps, devices) if comm is not None else IntraBench(
        not args.no_sweeps)
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    iters_cap = 3 if args.quick else 25
    rows, skipped = [], {}
    for name in names:
        got, skipped[name] = run_tree(bench, name, trees[name](), args.repeats,
                                      args.min_sample_ms / 1e3, iters_cap)
        rows += got
    if bench.rank != 0:
        return 0
    meta = {"mode": bench.mode, "devices": devices, "processes": 1 if comm is None
            else comm.Get_size(), "repeats": args.repeats, "quick": args.quick,
            "min_sample_ms": args.min_sample_ms, "trees": names,
            "tune_host_allocator": tuned,
            "methods": list(dict.fromkeys(r.method for r in rows)),
            "sweep_skipped": {t: s for t, s in skipped.items() if s},
            "env": {k: v for k, v in os.environ.items()
                    if k.startswith(("XLA_", "MALLOC_", "JAX_", "OMP_"))},
            "jax": jax.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "cpus": os.cpu_count(),
            "loadavg_start": load0, "loadavg_end": os.getloadavg(),
            "seconds": round(time.perf_counter() - t0, 1),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    targets = evaluate_targets(rows, devices)
    print_report(rows, targets, meta)
    for path in write_files(rows, targets, meta, args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

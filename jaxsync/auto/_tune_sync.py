"""The whole-sync part of ``python -m jaxsync tune``: each strategy's overhead.

What it is for: single collectives do not show everything a whole
synchronisation does on a backend (the dispatch of many ops, calls that overlap
or wait for one another, page faults of fresh result buffers, cores shared by
more devices and processes than they can run at once). ``tune`` therefore also
times whole syncs with each strategy's public factory (``jaxsync.naive_mean``,
...) in the README's ``jit(shard_map)`` step, on three synthetic float32 trees
that differ in leaves and bytes (never the bench's trees), and fits per
strategy the overhead per leaf and per byte that the collectives and copies
already fitted do not predict (``jaxsync.auto._cost_fit.fit_overhead``); then, on a
synthetic bfloat16 tree, each strategy's extra cost per byte of 16-bit data
(its conversions to float32 and back, the user-defined MPI sum).

May import: the standard library, numpy, JAX, jaxsync's public API and
``jaxsync.auto._cost``, ``_cost_ops``, ``_cost_fit``, ``_auto``, ``_plan``, ``_rounds``.
"""

from __future__ import annotations

import functools

import numpy as np

from . import _cost_fit, _cost_ops
from ._cost import Profile
from ._cost_ops import ModelTopology

KiB = 2**10

SYNC_TREES = {"few": (8, 64 * KiB), "many": (256, 256), "big": (8, 512 * KiB)}
QUICK_SYNC_TREES = {"few": (4, 16 * KiB), "many": (64, 256)}
"""Synthetic float32 trees: ``name: (leaves, elements per leaf)``."""
SYNC_TREES16 = {"half": (8, 256 * KiB)}
QUICK_SYNC_TREES16 = {"half": (4, 16 * KiB)}
"""Synthetic bfloat16 trees, as above."""
SYNC_STRATEGIES = ("naive", "flat", "hierarchical", "two_dimensional")


def _factory(strategy):
    import jaxsync

    return {
        "naive": jaxsync.naive_mean,
        "flat": jaxsync.flat_mean,
        "hierarchical": jaxsync.hierarchical_mean,
        "two_dimensional": jaxsync.two_dimensional_mean,
    }[strategy]


def measure_sync(
    comm, devices: int, trees: dict, rounds: int, iters: int, dtype: str = "float32"
) -> list:
    """``(strategy, tree, leaves, bytes, seconds)``: whole synchronisations with each
    strategy's factory (its default options) in the README's ``jit(shard_map)``
    step over the local devices, marginal to the same step without the sync."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from ._rounds import _control, _time_rounds

    mesh = Mesh(np.array(jax.local_devices()[:devices]), ("local",))
    sh = NamedSharding(mesh, P("local"))
    txs = {s: _factory(s)(axis_name="local", comm=comm) for s in SYNC_STRATEGIES}

    def step(tx):
        def body(t):
            g = jax.tree.map(lambda x: x[0] * 1.0001 + 1.0, t)
            if tx is not None:
                g = tx.update(g, tx.init(g))[0]
            return jax.tree.map(lambda x: x[None], g)

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("local"), out_specs=P("local")))

    out = []
    for name, (k, m) in trees.items():
        tree = {f"l{i:03d}": jax.device_put(jnp.ones((devices, m), dtype), sh) for i in range(k)}
        fns = {"base": functools.partial(step(None), tree)}
        fns |= {s: functools.partial(step(tx), tree) for s, tx in txs.items()}
        got = _time_rounds(fns, "base", rounds, iters, _control(comm))
        out += [(s, name, k, k * m * jnp.dtype(dtype).itemsize, got[s]) for s in SYNC_STRATEGIES]
    return out


def _modelled(
    strategy: str,
    leaves: int,
    elems: int,
    topo: ModelTopology,
    profile: Profile,
    dtype: str = "float32",
) -> float:
    """The model's seconds of a sync of ``leaves`` leaves with ``profile``."""
    import jax
    import jax.numpy as jnp

    from jaxsync._core._plan import make_plan

    from ._auto import buckets_of

    tree = {f"l{i:03d}": jax.ShapeDtypeStruct((elems,), jnp.dtype(dtype)) for i in range(leaves)}
    bucket_bytes, threshold = _cost_ops.strategy_defaults(strategy)
    plan = make_plan(
        tree,
        bucket_bytes=bucket_bytes,
        pack_threshold=threshold,
        per_leaf=_cost_ops.per_leaf_plan(strategy, topo, jnp.dtype(dtype).itemsize == 2),
    )
    return _cost_ops.predict(strategy, buckets_of(plan), topo, profile, bucket_bytes=bucket_bytes)


def fit_overheads(
    samples: list, trees: dict, topo: ModelTopology, profile: Profile
) -> tuple[tuple, dict]:
    """Each strategy's overhead from :func:`measure_sync`'s samples.

    Strategies that issue the same program here (``hierarchical`` and
    ``two_dimensional`` with one device per process: the leaves go to the
    native target as they are) are fitted together on their pooled samples, so
    that the same program gets the same prediction.
    """
    overheads, report = [], {}
    same = {"hierarchical", "two_dimensional"} if topo.local_devices == 1 else set()
    for s in SYNC_STRATEGIES:
        pool = same if s in same else {s}
        rows = [
            (k, n, t, _modelled(s, k, trees[name][1], topo, profile))
            for s_, name, k, n, t in samples
            if s_ in pool
        ]
        (per_leaf, per_byte), rep = _cost_fit.fit_overhead(rows, signed_leaf=s == "naive")
        overheads.append((s, (per_leaf, per_byte)))
        report[s] = rep
    return tuple(sorted(overheads)), report


def fit_overheads16(samples: list, trees: dict, topo: ModelTopology, profile: Profile) -> tuple:
    """Each strategy's seconds per byte of 16-bit data, from :func:`measure_sync`'s
    samples of bfloat16 trees: what ``profile`` (its overheads included) leaves
    unexplained, per 16-bit byte, never below zero. Same pooling as
    :func:`fit_overheads`.

    Example:
      >>> from jaxsync.auto._cost import DEFAULT_PROFILE
      >>> topo = ModelTopology(processes=1, hosts=1, local_devices=2, native=False)
      >>> t = _modelled("flat", 4, 1024, topo, DEFAULT_PROFILE, "bfloat16")
      >>> s = [(st, "half", 4, 8192, t + 8192 * 2e-9) for st in SYNC_STRATEGIES]
      >>> over, _ = fit_overheads16(s, {"half": (4, 1024)}, topo, DEFAULT_PROFILE)
      >>> round(dict(over)["flat"] * 1e9, 6)
      2.0
    """
    over, report = [], {}
    same = {"hierarchical", "two_dimensional"} if topo.local_devices == 1 else set()
    for s in SYNC_STRATEGIES:
        pool = same if s in same else {s}
        rows = [
            (t, _modelled(s, k, trees[name][1], topo, profile, "bfloat16"), n)
            for s_, name, k, n, t in samples
            if s_ in pool
        ]
        per_byte = max(0.0, float(np.median([(t - m) / n for t, m, n in rows])))
        after = [abs(m + per_byte * n - t) / t for t, m, n in rows]
        report[s] = {
            "median_rel_error_before": float(np.median([abs(m - t) / t for t, m, _ in rows])),
            "median_rel_error": float(np.median(after)),
            "samples": len(rows),
        }
        over.append((s, per_byte))
    return tuple(sorted(over)), report


def calibrate(comm, devices: int, quick: bool, rounds: int, iters: int, topo, profile, log):
    """``tune``'s whole-sync part: ``profile`` with its overheads, the fit
    reports and the raw samples (``topo``: ``jaxsync._comm._topology.Topology``)."""
    import dataclasses

    trees = QUICK_SYNC_TREES if quick else SYNC_TREES
    trees16 = QUICK_SYNC_TREES16 if quick else SYNC_TREES16
    log(f"whole syncs of {len(trees)} + {len(trees16)} synthetic trees per strategy")
    model_topo = ModelTopology(
        processes=topo.size,
        hosts=topo.hosts,
        local_devices=devices,
        native=comm is not None,
        broadcast=comm is not None,
    )
    # Whole syncs are noisier than single collectives (more ops, more threads)
    # and they are what the overheads are fitted on: one more round.
    s = measure_sync(comm, devices, trees, rounds + 1, iters)
    over, rep = fit_overheads(s, trees, model_topo, profile)
    profile = dataclasses.replace(profile, overheads=over)
    s16 = measure_sync(comm, devices, trees16, max(2, rounds - 1), iters, dtype="bfloat16")
    over16, rep16 = fit_overheads16(s16, trees16, model_topo, profile)
    profile = dataclasses.replace(profile, overheads16=over16)
    return profile, {"overheads": rep, "overheads16": rep16}, {"sync": s, "sync16": s16}


def format_overheads16(profile: Profile) -> list[str]:
    """``tune``'s lines for the 16-bit overheads."""
    rep = (profile.fit or {}).get("overheads16", {})
    return [
        f"  {name:<16} 16-bit   {per_byte * 1e9:+8.4f} ns/B | whole-sync error median "
        f"{100 * rep.get(name, {}).get('median_rel_error_before', 0):.0f}% -> "
        f"{100 * rep.get(name, {}).get('median_rel_error', 0):.0f}% over "
        f"{rep.get(name, {}).get('samples')} sample(s) (fitted on them)"
        for name, per_byte in profile.overheads16
    ]

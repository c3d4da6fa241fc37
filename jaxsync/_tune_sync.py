"""The whole-sync part of ``python -m jaxsync tune``: each strategy's overhead.

What it is for: single collectives do not show everything a whole
synchronisation does on a backend (the dispatch of many ops, calls that overlap
or wait for one another, page faults of fresh result buffers, cores shared by
more devices and processes than they can run at once). ``tune`` therefore also
times whole syncs with each strategy's public factory (``jaxsync.naive_mean``,
...) in the README's ``jit(shard_map)`` step, on three synthetic float32 trees
that differ in leaves and bytes (never the bench's trees), and fits per
strategy the overhead per leaf and per byte that the collectives and copies
already fitted do not predict (``jaxsync._cost_fit.fit_overhead``).

May import: the standard library, numpy, JAX, jaxsync's public API and
``jaxsync._cost``, ``_cost_ops``, ``_cost_fit``, ``_auto``, ``_plan``, ``_tune``.
"""

from __future__ import annotations

import functools

import numpy as np

from . import _cost_fit, _cost_ops
from ._cost import Profile
from ._cost_ops import ModelTopology

KiB = 2**10

SYNC_TREES = {"few": (8, 64 * KiB), "many": (128, 256), "big": (8, 512 * KiB)}
QUICK_SYNC_TREES = {"few": (4, 16 * KiB), "many": (64, 256)}
"""Synthetic float32 trees: ``name: (leaves, elements per leaf)``."""
SYNC_STRATEGIES = ("naive", "flat", "hierarchical", "two_dimensional")


def _factory(strategy):
    import jaxsync

    return {
        "naive": jaxsync.naive_mean,
        "flat": jaxsync.flat_mean,
        "hierarchical": jaxsync.hierarchical_mean,
        "two_dimensional": jaxsync.two_dimensional_mean,
    }[strategy]


def measure_sync(comm, devices: int, trees: dict, rounds: int, iters: int) -> list:
    """``(strategy, tree, leaves, bytes, seconds)``: whole synchronisations with each
    strategy's factory (its default options) in the README's ``jit(shard_map)``
    step over the local devices, marginal to the same step without the sync."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from ._tune import _control, _time_rounds

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
        tree = {
            f"l{i:03d}": jax.device_put(jnp.ones((devices, m), jnp.float32), sh) for i in range(k)
        }
        fns = {"base": functools.partial(step(None), tree)}
        fns |= {s: functools.partial(step(tx), tree) for s, tx in txs.items()}
        got = _time_rounds(fns, "base", rounds, iters, _control(comm))
        out += [(s, name, k, k * m * 4, got[s]) for s in SYNC_STRATEGIES]
    return out


def _modelled(
    strategy: str, leaves: int, elems: int, topo: ModelTopology, profile: Profile
) -> float:
    """The model's seconds of a sync of ``leaves`` float32 leaves, without overhead."""
    import jax
    import jax.numpy as jnp

    from ._auto import buckets_of
    from ._plan import make_plan

    tree = {f"l{i:03d}": jax.ShapeDtypeStruct((elems,), jnp.float32) for i in range(leaves)}
    bucket_bytes, threshold = _cost_ops.strategy_defaults(strategy)
    plan = make_plan(
        tree,
        bucket_bytes=bucket_bytes,
        pack_threshold=threshold,
        per_leaf=_cost_ops.per_leaf_plan(strategy, topo),
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

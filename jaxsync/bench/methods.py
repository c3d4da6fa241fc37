"""The synchronisations under test: jaxsync's strategies as ``tree -> tree`` functions.

What it is for: the rows of kind ``jaxsync`` and ``sweep`` (every strategy with
default options, ``comm_dtype=bfloat16``, host staging, and ``flat_mean`` swept over
``bucket_bytes`` / ``pack_threshold``), and the fake gradient work of the step.
Written as a user would: each row is ``tx.update(g, tx.init(g))[0]`` of a public
factory. What it may import: jax, ``jaxsync`` (its public API, ``jaxsync.__all__``)
and ``jaxsync.bench.trees``.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxsync.bench import methods
  >>> syncs = methods.jaxsync_methods("i", None, mpi=False)
  >>> sorted(syncs)
  ['flat', 'hierarchical', 'hierarchical bf16', 'naive', 'single_node', 'two_dimensional']
  >>> jax.vmap(syncs["flat"], axis_name="i")({"w": jnp.arange(4.0)})["w"]
  Array([1.5, 1.5, 1.5, 1.5], dtype=float32)
"""

from __future__ import annotations

from collections.abc import Callable

from .trees import KiB, MiB

AXIS = "d"
LOCAL = "local"  # the local mesh axis under mpirun (the README's pattern)
STRATEGY_METHODS = ("naive", "flat", "hierarchical", "two_dimensional")
DEFAULT_METHOD = "hierarchical"
FLAT_DEFAULTS = {"bucket_bytes": 4 * MiB, "pack_threshold": None}
"""``flat_mean``'s documented defaults (its docstring: 4 MiB, ``None``): the plan
of plain ``flat``, which the sweep does not measure twice (tests/test_bench.py
checks that they are the library's)."""


def fake_grads(tree):
    """Cheap per-leaf work standing in for the gradient computation."""
    import jax
    import jax.numpy as jnp

    return jax.tree.map(lambda x: x * jnp.asarray(1.0001, x.dtype) + jnp.asarray(1, x.dtype), tree)


def _transform_sync(factory, **options):
    tx = factory(**options)

    def sync(g):
        return tx.update(g, tx.init(g))[0]

    return sync


def jaxsync_methods(
    axis_name, comm, mpi: bool, host: bool = False, tiered: bool = False
) -> dict[str, Callable]:
    """jaxsync's strategies as per-replica ``tree -> tree`` functions; ``tiered``
    (several hosts, several processes on one) adds float32 forced through the host
    tier (``host_tier=True``) beside the defaults' choice."""
    import jax.numpy as jnp

    import jaxsync

    common = dict(axis_name=axis_name, comm=comm)
    out = {
        "naive": _transform_sync(jaxsync.naive_mean, **common),
        "flat": _transform_sync(jaxsync.flat_mean, **common),
        # the default: hierarchical_mean with default options
        DEFAULT_METHOD: _transform_sync(jaxsync.hierarchical_mean, **common),
        "two_dimensional": _transform_sync(jaxsync.two_dimensional_mean, **common),
    }
    if host:
        out["flat host"] = _transform_sync(jaxsync.flat_mean, staging="host", **common)
    if not mpi:
        out["single_node"] = _transform_sync(jaxsync.single_node_mean, axis_name=axis_name)
    out[f"{DEFAULT_METHOD} bf16"] = _transform_sync(
        jaxsync.hierarchical_mean, comm_dtype=jnp.bfloat16, **common
    )
    if tiered:  # float32 through the host tier too, beside the default's choice
        for name, factory in (
            (DEFAULT_METHOD, jaxsync.hierarchical_mean),
            ("two_dimensional", jaxsync.two_dimensional_mean),
        ):
            out[f"{name} host_tier=True"] = _transform_sync(factory, host_tier=True, **common)
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

    configs: list[tuple[int | None, int | None]] = [
        (b, None) for b in (256 * KiB, 16 * MiB, 64 * MiB, None)
    ]
    configs += [(64 * MiB, t) for t in (64 * KiB, 256 * KiB, 1 * MiB)]

    def plan(b, t):
        return jaxsync.make_plan(tree, bucket_bytes=b, pack_threshold=t).buckets

    seen = {plan(FLAT_DEFAULTS["bucket_bytes"], FLAT_DEFAULTS["pack_threshold"]): "flat"}
    methods, skipped = {}, {}
    for b, t in configs:
        name = f"flat b={_fmt_bytes(b)} t={_fmt_bytes(t)}"
        key = plan(b, t)
        if key in seen:
            skipped[name] = seen[key]
            continue
        seen[key] = name
        methods[name] = _transform_sync(
            jaxsync.flat_mean, axis_name=axis_name, comm=comm, bucket_bytes=b, pack_threshold=t
        )
    return methods, skipped

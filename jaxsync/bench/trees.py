"""The benchmark's gradient trees: per-replica shapes as ``jax.ShapeDtypeStruct`` trees.

What it is for: the ResNet-like, 500-small-leaf, transformer-like and mixed-precision
trees every suite times (``make_trees``), and their size (``tree_info``).
What it may import: jax and the standard library only (no jaxsync, no other
``jaxsync.bench`` module).

Example:
  >>> from jaxsync.bench import trees
  >>> trees.tree_info(trees.resnet18_like())
  (47, 5502728, 22010912)
  >>> sorted(trees.make_trees(quick=True))
  ['mixed_tiny']
"""

from __future__ import annotations

import math
from collections.abc import Callable

KiB, MiB = 2**10, 2**20
SWEEP_TREES = ("resnet18", "small500", "mixed_tiny")
"""Trees on which the flat bucket_bytes / pack_threshold sweep runs."""


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
        tree[name] = {
            "kernel": _spec((k, k, cin, cout)),
            "bn": {"scale": _spec((cout,)), "bias": _spec((cout,))},
        }

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


def transformer_like(
    layers: int = 6, d: int = 256, ff: int = 1024, matrix_dtype: str = "float32", embed: int = 0
) -> dict:
    """Attention qkv/out, MLP and two layer norms per layer, a final norm.

    Matrices are ``matrix_dtype``; biases and norms stay float32 (the usual
    mixed-precision layout). ``embed`` > 0 adds a float32 embedding table.
    """

    def dense(din, dout):
        return {"kernel": _spec((din, dout), matrix_dtype), "bias": _spec((dout,))}

    def norm():
        return {"scale": _spec((d,)), "bias": _spec((d,))}

    tree: dict = {
        f"layer{i}": {
            "qkv": dense(d, 3 * d),
            "out": dense(d, d),
            "mlp_in": dense(d, ff),
            "mlp_out": dense(ff, d),
            "ln1": norm(),
            "ln2": norm(),
        }
        for i in range(layers)
    }
    tree["ln_f"] = norm()
    if embed:
        tree["embed"] = _spec((embed, d))
    return tree


def make_trees(quick: bool) -> dict[str, Callable[[], dict]]:
    if quick:  # one tiny tree with both dtypes: every method and sweep, fast to compile
        return {"mixed_tiny": lambda: transformer_like(2, 64, 256, "bfloat16", 300)}
    return {
        "resnet18": resnet18_like,
        "small500": small_leaves,
        "transformer": transformer_like,
        "mixed": lambda: transformer_like(4, 256, 1024, "bfloat16", 1000),
    }


def tree_info(tree) -> tuple[int, int, int]:
    """(leaves, params, bytes) of a tree of ShapeDtypeStructs."""
    import jax

    leaves = jax.tree.leaves(tree)
    params = sum(math.prod(x.shape) for x in leaves)
    nbytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)
    return len(leaves), params, nbytes

"""The trees a projection prices: named ones, a parameter count, or a saved spec.

What it is for: ``python -m jaxsync tune --project`` answers a question about
the user's own model, so its tree can be given three ways: a name (the bench's
trees, ``resnet50``, ``transformer1b``), a parameter count (``--params 7e9``:
leaves of a transformer-like shape holding that many float32 numbers), or a
file written from the user's parameters with :func:`save_tree_spec` (leaf
paths, shapes and dtypes; no values). Nothing here allocates arrays.

May import: the standard library, JAX (``ShapeDtypeStruct`` only) and
``jaxsync.bench.trees`` (inside :func:`named_trees`).

Example:
  >>> import jax.numpy as jnp, json, tempfile, os
  >>> from jaxsync.auto._project_trees import save_tree_spec, load_tree
  >>> path = os.path.join(tempfile.mkdtemp(), "tree.json")
  >>> save_tree_spec({"w": jnp.zeros((4, 8)), "b": jnp.zeros(8, jnp.bfloat16)}, path)
  >>> from pathlib import Path
  >>> spec = json.loads(Path(path).read_text())
  >>> sorted((k, v["shape"], v["dtype"]) for k, v in spec["leaves"].items())
  [('b', [8], 'bfloat16'), ('w', [4, 8], 'float32')]
  >>> tree, label = load_tree(tree_file=path)
  >>> label
  'tree.json (40 params, 2 leaves)'
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

TREE_FORMAT = "jaxsync-tree-1"


def _spec(shape, dtype="float32"):
    import jax
    import jax.numpy as jnp

    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def resnet50_tree() -> dict:
    """ResNet-50's parameter shapes: 161 leaves, 25.6 M float32."""
    tree = {}

    def conv(name, k, cin, cout):
        tree[name] = {
            "kernel": _spec((k, k, cin, cout)),
            "bn": {"scale": _spec((cout,)), "bias": _spec((cout,))},
        }

    conv("stem", 7, 3, 64)
    cin = 64
    for stage, (blocks, w) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512))):
        for b in range(blocks):
            conv(f"s{stage}b{b}c1", 1, cin, w)
            conv(f"s{stage}b{b}c2", 3, w, w)
            conv(f"s{stage}b{b}c3", 1, w, 4 * w)
            if b == 0:
                conv(f"s{stage}b{b}down", 1, cin, 4 * w)
            cin = 4 * w
    tree["fc"] = {"kernel": _spec((2048, 1000)), "bias": _spec((1000,))}
    return tree


def transformer_1b_tree() -> dict:
    """A 1.0 B-parameter transformer: 18 layers, d=2048, ff=8192, 50k vocabulary, f32."""
    return transformer_tree(18, 2048, 50304)


def transformer_tree(layers: int, d: int, vocab: int = 50304, dtype: str = "float32") -> dict:
    """A transformer's parameter shapes: ``layers`` blocks of width ``d`` (ff 4d)."""

    def dense(a, b):
        return {"kernel": _spec((a, b), dtype), "bias": _spec((b,), dtype)}

    tree: dict = {
        f"layer{i:03d}": {
            "qkv": dense(d, 3 * d),
            "out": dense(d, d),
            "mlp_in": dense(d, 4 * d),
            "mlp_out": dense(4 * d, d),
            "ln1": {"scale": _spec((d,), dtype), "bias": _spec((d,), dtype)},
            "ln2": {"scale": _spec((d,), dtype), "bias": _spec((d,), dtype)},
        }
        for i in range(layers)
    }
    tree["embed"] = _spec((vocab, d), dtype)
    return tree


def params_tree(params: float, dtype: str = "float32") -> dict:
    """A transformer-like tree of about ``params`` parameters (within 1 %, at
    least one layer): width ``d`` such that ``12 d^2`` per layer times ``d / 128``
    layers is about ``params``, layers to fill the count, the rest in the
    embedding. What the model needs is the bytes and the number and sizes of
    leaves; the output calls this tree a stand-in.

    Example:
      >>> import math, jax
      >>> n = sum(math.prod(x.shape) for x in jax.tree.leaves(params_tree(7e9)))
      >>> abs(n / 7e9 - 1) < 0.01
      True
    """
    if not (isinstance(params, (int, float)) and math.isfinite(params) and params >= 1e5):
        raise ValueError(
            f"--params must be a number of parameters >= 1e5, got {params!r}. "
            "Fix: e.g. --params 7e9."
        )
    d = max(256, 128 * round((params * 128 / 12) ** (1 / 3) / 128))  # layers ~ d / 128
    per_layer = 12 * d * d + 13 * d
    vocab = 32000
    layers = max(1, round((params - vocab * d) / per_layer))
    left = params - layers * per_layer
    vocab = max(1, round(left / d))
    return transformer_tree(layers, d, vocab, dtype)


def named_trees() -> dict:
    """Trees known by name: the bench's and the projection's."""
    from jaxsync.bench import trees as _trees

    return {
        **_trees.make_trees(False),
        **_trees.make_trees(True),
        "resnet50": resnet50_tree,
        "transformer1b": transformer_1b_tree,
    }


def tree_spec(tree) -> dict:
    """``{"format", "leaves": {path: {"shape", "dtype"}}}`` of a pytree of arrays
    or ``ShapeDtypeStruct`` (anything with ``.shape`` and ``.dtype``)."""
    import jax

    leaves = {}
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        name = jax.tree_util.keystr(path, simple=True, separator="/") or "leaf"
        leaves[name] = {"shape": [int(s) for s in x.shape], "dtype": str(x.dtype)}
    return {"format": TREE_FORMAT, "leaves": leaves}


def save_tree_spec(tree: Any, path: str | os.PathLike) -> None:
    """Write the shapes and dtypes of ``tree``'s leaves (no values) to ``path``
    as JSON, for ``python -m jaxsync tune --project --tree-file PATH``.

    Args:
      tree: the model's parameters (or gradients): a pytree of arrays or
        ``jax.ShapeDtypeStruct``.
      path: the file to write.

    Returns:
      None; the file at ``path`` holds ``{"format", "leaves": {name: {"shape",
      "dtype"}}}``.

    Example:
      >>> import jax.numpy as jnp, tempfile, os, jaxsync
      >>> from pathlib import Path
      >>> p = os.path.join(tempfile.mkdtemp(), "t.json")
      >>> jaxsync.save_tree_spec({"w": jnp.zeros((2, 3))}, p)
      >>> Path(p).read_text().count("float32")
      1
    """
    Path(path).write_text(json.dumps(tree_spec(tree), indent=1))


def load_tree_spec(path) -> dict:
    """The tree of ``ShapeDtypeStruct`` written by :func:`save_tree_spec`."""
    path = Path(path)
    if not path.exists():
        raise ValueError(
            f"--tree-file {path} does not exist. Fix: write it from your parameters "
            f"with `jaxsync.save_tree_spec(params, {str(path)!r})`."
        )
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"--tree-file {path} is not JSON ({e}).") from None
    if not isinstance(data, dict) or data.get("format") != TREE_FORMAT:
        raise ValueError(
            f"--tree-file {path}: expected a JSON object with format {TREE_FORMAT!r}, "
            f"got format {data.get('format') if isinstance(data, dict) else None!r}. "
            "Fix: write it with `jaxsync.save_tree_spec(params, path)`."
        )
    tree = {}
    for name, leaf in (data.get("leaves") or {}).items():
        try:
            tree[name] = _spec(leaf["shape"], leaf["dtype"])
        except (KeyError, TypeError) as e:
            raise ValueError(
                f"--tree-file {path}: leaf {name!r} needs 'shape' and 'dtype', got {leaf!r}"
            ) from e
    if not tree:
        raise ValueError(f"--tree-file {path} has no leaves.")
    return tree


def load_tree(name: str | None = None, params: float | None = None, tree_file=None):
    """``(tree, label)`` from exactly one of a name, a parameter count, a file."""
    import jax

    given = [x is not None for x in (name, params, tree_file)]
    if sum(given) != 1:
        raise ValueError(
            f"give exactly one of --tree NAME, --params N, --tree-file PATH (got {sum(given)})."
        )
    if tree_file is not None:
        tree = load_tree_spec(tree_file)
        what = Path(tree_file).name
    elif params is not None:
        tree = params_tree(float(params))
        what = f"transformer-like stand-in for {float(params):.3g} params"
    else:
        trees = named_trees()
        if name not in trees:
            raise ValueError(f"unknown tree {name!r}; choose from {sorted(trees)}")
        tree, what = trees[name](), str(name)
    leaves = jax.tree.leaves(tree)
    n = sum(math.prod(x.shape) for x in leaves)
    return tree, f"{what} ({n} params, {len(leaves)} leaves)"

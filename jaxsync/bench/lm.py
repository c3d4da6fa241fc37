"""A small byte-level transformer language model on a corpus that needs no download.

The corpus is Python's own standard library source (the ``*.py`` files at the
top of ``sysconfig``'s ``stdlib`` directory, in name order): every tenth file is
held out for evaluation, the rest is the training text. Bytes are the tokens
(256 of them). The model is a pre-norm decoder (``layers`` blocks of causal
multi-head attention and a 4x MLP, learned positions, the output tied to the
embedding) in plain JAX. Batches are random crops of ``seq + 1`` bytes drawn
from a generator seeded by ``(seed, step, island)``, so each island reads its
own data and a rerun reads the same.

What it may import: numpy, jax (inside functions) and the standard library.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np


def corpus(max_bytes: int = 4_000_000) -> tuple[np.ndarray, np.ndarray]:
    """``(train, eval)`` byte arrays of the standard library's top-level sources.

    Example:
      >>> from jaxsync.bench.lm import corpus
      >>> train, held = corpus(200_000)
      >>> train.dtype, len(train) <= 200_000, len(held) > 0
      (dtype('uint8'), True, True)
    """
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    if len(files) < 20:
        raise RuntimeError(
            f"jaxsync bench lm: found {len(files)} Python files in "
            f"{sysconfig.get_paths()['stdlib']}, expected the standard library's sources"
        )
    train: list[bytes] = []
    held: list[bytes] = []
    sizes = [0, 0]
    for i, f in enumerate(files):
        part, k = (held, 1) if i % 10 == 9 else (train, 0)
        limit = max_bytes if k == 0 else max_bytes // 8
        if sizes[k] >= limit:
            continue
        text = f.read_bytes()[: limit - sizes[k]]
        part.append(text)
        sizes[k] += len(text)
    return (np.frombuffer(b"".join(train), np.uint8), np.frombuffer(b"".join(held), np.uint8))


def init(seed: int = 0, d: int = 128, layers: int = 2, seq: int = 64) -> dict:
    """The model's parameters (float32), the same for a given seed on every process."""
    import jax
    import jax.numpy as jnp

    key = jax.random.PRNGKey(seed)
    keys = iter(jax.random.split(key, 4 + 4 * layers))

    def dense(n_in, n_out):
        return jax.random.normal(next(keys), (n_in, n_out), jnp.float32) / np.sqrt(n_in)

    params: dict = {
        "embed": jax.random.normal(next(keys), (256, d), jnp.float32) * 0.02,
        "pos": jax.random.normal(next(keys), (seq, d), jnp.float32) * 0.02,
        "norm": jnp.ones((d,), jnp.float32),
        "blocks": [],
    }
    for _ in range(layers):
        params["blocks"].append(
            {
                "norm1": jnp.ones((d,), jnp.float32),
                "qkv": dense(d, 3 * d),
                "out": dense(d, d) / np.sqrt(2 * layers),
                "norm2": jnp.ones((d,), jnp.float32),
                "up": dense(d, 4 * d),
                "up_b": jnp.zeros((4 * d,), jnp.float32),
                "down": dense(4 * d, d) / np.sqrt(2 * layers),
            }
        )
    return params


def _norm(x, scale):
    import jax.numpy as jnp

    return x * scale / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def loss(params: dict, tokens, heads: int = 4):
    """Mean next-byte cross-entropy (nats) of ``tokens`` ``(batch, seq + 1)``."""
    import jax
    import jax.numpy as jnp

    x_in, y = tokens[:, :-1], tokens[:, 1:]
    b, t = x_in.shape
    d = params["embed"].shape[1]
    h = params["embed"][x_in] + params["pos"][:t]
    mask = jnp.tril(jnp.ones((t, t), bool))
    for blk in params["blocks"]:
        q, k, v = jnp.split(_norm(h, blk["norm1"]) @ blk["qkv"], 3, axis=-1)
        q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
        att = jnp.einsum("bqhc,bkhc->bhqk", q, k) / np.sqrt(d // heads)
        att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
        h = h + jnp.einsum("bhqk,bkhc->bqhc", att, v).reshape(b, t, d) @ blk["out"]
        up = jax.nn.gelu(_norm(h, blk["norm2"]) @ blk["up"] + blk["up_b"])
        h = h + up @ blk["down"]
    logits = _norm(h, params["norm"]) @ params["embed"].T
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, y[..., None], axis=-1))


def batch(data: np.ndarray, batch_size: int, seq: int, step: int, island: int, seed: int = 0):
    """``batch_size`` random crops of ``seq + 1`` bytes (int32), drawn for
    ``(seed, step, island)``: each island its own, a rerun the same.

    Example:
      >>> import numpy as np
      >>> from jaxsync.bench.lm import batch
      >>> data = np.arange(100, dtype=np.uint8)
      >>> a = batch(data, 2, 4, step=3, island=1)
      >>> a.shape, bool((np.diff(a, axis=1) == 1).all())
      ((2, 5), True)
      >>> bool((a == batch(data, 2, 4, step=3, island=1)).all())
      True
    """
    rng = np.random.default_rng([seed, step, island])
    start = rng.integers(0, len(data) - seq - 1, size=batch_size)
    return np.stack([data[s : s + seq + 1] for s in start]).astype(np.int32)

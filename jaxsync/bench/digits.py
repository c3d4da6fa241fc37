"""A small convergence experiment for the compressed transforms (tests, notebook).

A 64-64-10 MLP on scikit-learn's bundled digits (no download), data-parallel
over ``replicas`` replicas under ``jax.vmap(axis_name="i")`` in one process
(``comm=None``), Adam on top of the synchronisation. The same seeds give the
same initial parameters and the same batches for every synchroniser, so runs
differ only by how the gradients are averaged.

May import: JAX, optax, numpy and (lazily) scikit-learn; no jaxsync module (the
synchroniser comes in as an argument). tests/test_compress.py and
notebooks/compression.ipynb use it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax


def load(seed: int = 0):
    """``(x_train, y_train, x_test, y_test)``: a fixed 80/20 split of digits."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(0.8 * len(x))
    tr, te = order[:cut], order[cut:]
    return x[tr], y[tr], x[te], y[te]


def init_params(seed: int = 0, hidden: int = 64):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {
        "l1": {"kernel": jax.random.normal(k1, (64, hidden)) / 8.0, "bias": jnp.zeros(hidden)},
        "l2": {
            "kernel": jax.random.normal(k2, (hidden, 10)) / np.sqrt(hidden),
            "bias": jnp.zeros(10),
        },
    }


def logits(params, x):
    h = jax.nn.relu(x @ params["l1"]["kernel"] + params["l1"]["bias"])
    return h @ params["l2"]["kernel"] + params["l2"]["bias"]


def loss_fn(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits(params, x), y).mean()


def train(
    sync,
    steps: int = 300,
    replicas: int = 4,
    batch: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    every: int = 25,
):
    """Train with ``optax.chain(sync, optax.adam(lr))``.

    Returns ``(params, curve)``: replica 0's final parameters (every replica
    holds the same) and a list of ``(step, train loss, test accuracy)``.
    """
    xtr, ytr, xte, yte = load(seed)
    tx = optax.chain(sync, optax.adam(lr))
    params = init_params(seed)
    stacked = jax.tree.map(lambda p: jnp.broadcast_to(p, (replicas, *p.shape)), params)
    state = jax.vmap(tx.init)(stacked)

    def step(p, s, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, jax.lax.pmean(loss, "i")

    step = jax.jit(jax.vmap(step, axis_name="i"))
    accuracy = jax.jit(lambda p: jnp.mean(jnp.argmax(logits(p, xte), -1) == yte))
    rng = np.random.default_rng(seed + 1)
    curve = []
    p, s = stacked, state
    for t in range(1, steps + 1):
        idx = rng.integers(0, len(xtr), (replicas, batch))
        p, s, loss = step(p, s, xtr[idx], ytr[idx])
        if t % every == 0 or t == steps:
            p0 = jax.tree.map(lambda a: a[0], p)
            curve.append((t, float(loss[0]), float(accuracy(p0))))
    return p, curve

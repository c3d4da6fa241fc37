"""A zero-size leaf under shard_map: the README's step with ``out_specs=P()``.

A reduced leaf with no elements is in no buffer; it used to come back with the
input's axis type (varying over the mesh axis once ``share_invariant`` had
marked it), so a step returning the parameters replicated failed to trace with
every chain strategy (issue 46, item 8).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _common import INTER, MESH1, MESH2, STRATEGIES, N, bits
from jax.sharding import PartitionSpec as P

import jaxsync

CASES = [(s, "i", {}) for s in STRATEGIES] + [("auto", "i", {})]
CASES += [(s, "local", {"overlap": True}) for s in INTER]


def _tx(strategy, axis, opts):
    fac = getattr(jaxsync, f"{strategy}_mean")
    if strategy == "single_node":
        return fac(axis_name=axis, **opts)
    comm = jaxsync.AxisComm("host") if axis == "local" else None
    if strategy == "auto":
        opts = {"overlap": False, **opts}  # no inter stage: nothing to overlap
    return fac(axis_name=axis, comm=comm, **opts)


@pytest.mark.filterwarnings("ignore:jaxsync.auto_mean")
@pytest.mark.parametrize(
    "strategy,axis,opts", CASES, ids=[f"{s}-{a}-{'-'.join(o)}" for s, a, o in CASES]
)
def test_zero_size_leaf_in_readme_shard_map_step(strategy, axis, opts):
    tx = optax.chain(_tx(strategy, axis, opts), optax.sgd(1.0))
    mesh = MESH1 if axis == "i" else MESH2
    spec = P("i") if axis == "i" else P(("host", "local"))

    def loss_fn(p, x):  # per device: w's gradient is the device's x
        return jnp.sum(x @ p["w"]) + jnp.sum(p["e"]) + jnp.sum(p["h"]).astype(jnp.float32)

    def step(p, s, x):
        g = jax.grad(loss_fn)(p, x)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), spec), out_specs=(P(), P())))
    p = {
        "w": jnp.zeros((4,)),
        "e": jnp.zeros((0, 3)),
        "h": jnp.zeros((2, 0), jnp.bfloat16),
    }
    x = jnp.arange(N, dtype=jnp.float32)[:, None] * jnp.ones((N, 4))  # row d: d
    s = tx.init(p)
    out, s = f(p, s, x)
    want = np.full(4, -(N - 1) / 2, np.float32)  # minus the mean of 0..N-1
    assert np.array_equal(bits(out["w"]), bits(want)), out["w"]
    assert out["e"].shape == (0, 3) and out["e"].dtype == jnp.float32
    assert out["h"].shape == (2, 0) and out["h"].dtype == jnp.bfloat16

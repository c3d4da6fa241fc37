"""float16's default predivide: by the largest power of two not above the replica
count (exact), the rest divided after the sum (issue 46, item 12).

Predividing by the replica count itself rounded every value (3 replicas: 44 of
289 float16 elements one step off Horovod's exact average). Integer data whose
sums are exact in float16 must now give the exact mean correctly rounded, bit
for bit, with every strategy, in one stage (3 devices) and two (2 x 3 over an
``AxisComm``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _common import STRATEGIES, bits
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxsync

SHAPE = (17, 17)  # 289 elements


def _data(n: int) -> np.ndarray:
    """Integers in [-300, 300] per replica: every partial sum (also halved or
    quartered, the predivide) is exact in float16; their means are thirds."""
    rng = np.random.default_rng(46)
    return rng.integers(-300, 301, size=(n, *SHAPE)).astype(np.float64)


def _exact_mean(x: np.ndarray) -> np.ndarray:
    """The mean rounded once to float16 (the sum is exact; float64 division of an
    integer by 3 or 6 is never near a float16 rounding tie)."""
    return (x.sum(axis=0) / len(x)).astype(np.float16)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("hosts", [1, 2])
def test_float16_mean_of_3_or_6_replicas_is_the_exact_average(strategy, hosts):
    if hosts == 2 and strategy == "single_node":
        pytest.skip("single_node has no inter-process stage")
    devices = np.array(jax.devices()[: 3 * hosts]).reshape(hosts, 3)
    mesh = Mesh(devices, ("host", "local"))
    fac = getattr(jaxsync, f"{strategy}_mean")
    if strategy == "single_node":
        tx = fac(axis_name=("host", "local"))
    elif hosts == 2:
        tx = fac(axis_name="local", comm=jaxsync.AxisComm("host"))
    else:
        tx = fac(axis_name=("host", "local"), comm=None)

    def body(g):
        out, _ = tx.update({"g": g[0, 0]}, tx.init({"g": g[0, 0]}))
        return out["g"][None, None]

    spec = P("host", "local")
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    x = _data(3 * hosts)
    got = np.asarray(f(jnp.asarray(x.reshape(hosts, 3, *SHAPE), jnp.float16)))
    want = _exact_mean(x)
    assert len(np.unique(want)) > 100  # many thirds: the rounding is exercised
    differ = [int((bits(g) != bits(want)).sum()) for g in got.reshape(3 * hosts, *SHAPE)]
    assert differ == [0] * (3 * hosts), f"{differ} of {want.size} elements differ"
    if hosts == 1:
        # Random float16 data: the sum rounded once to float16 (the wire's type),
        # then divided by 3 and rounded: no rounding of the values themselves.
        r = np.random.default_rng(3).standard_normal((3, *SHAPE)).astype(np.float16)
        got = np.asarray(f(jnp.asarray(r[None])))
        total = r.astype(np.float64).sum(axis=0).astype(np.float16)
        want = (total.astype(np.float32) / np.float32(3)).astype(np.float16)
        differ = [int((bits(g) != bits(want)).sum()) for g in got.reshape(3, *SHAPE)]
        assert differ == [0] * 3, f"{differ} of {want.size} elements differ"

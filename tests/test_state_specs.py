"""The docs' shard_map recipe for per-replica state (issue 32, defect 4).

``specs = jaxsync.state_specs(jax.eval_shape(tx.init, params), axes)`` and
``state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)``
for every transform whose state holds each replica's own values (double
buffering's pending gradients, sign's and PowerSGD's residuals), with a scalar
parameter: ``P(axes)`` stacks every device's value along a first axis, so a
scalar's is kept as ``(1,)``. A few steps on a (host=2, local=4) mesh with
``AxisComm("host")``, integer-valued gradients, compared bitwise with the
closed form.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _common import MESH2, bits
from jax.sharding import PartitionSpec as P

import jaxsync

AXES = ("host", "local")
N = 8  # replicas: 2 hosts x 4 local devices
STEPS = 3
COMM = jaxsync.AxisComm("host")

DOUBLE = ("naive_mean", "flat_mean", "hierarchical_mean", "two_dimensional_mean", "auto_mean")
# name: (make, delayed); delayed: the update at step t applies step t - 1's mean
CASES = {
    name: (lambda name=name: getattr(jaxsync, name)("local", COMM, double_buffering=True), True)
    for name in DOUBLE
}
CASES["sign_mean"] = (lambda: jaxsync.sign_mean("local", COMM, min_size=1), False)
CASES["powersgd_mean"] = (
    lambda: jaxsync.powersgd_mean("local", COMM, min_compression_rate=0.0, start_step=0),
    False,
)


def _grads(t):
    """Replica r's gradients at step t, stacked over the replicas: integers.

    ``w`` is constant within each replica, so sign_mean sends it exactly (its
    scale is |w|) and keeps zero residuals: every mean below is exact.
    """
    r = np.arange(N, dtype=np.float32)
    return {
        "t": jnp.asarray(r + 1 + 8 * t),
        "w": jnp.asarray(np.repeat((2 * r + 1 + t)[:, None], 3, axis=1)),
    }


@pytest.mark.parametrize("name", sorted(CASES))
def test_state_specs_recipe_with_a_scalar_parameter(name):
    make, delayed = CASES[name]
    tx = make()
    params = {"t": jnp.float32(0.0), "w": jnp.zeros(3, jnp.float32)}
    # No leaf here is a matrix: powersgd_mean says, once, that it compresses nothing.
    with (
        pytest.warns(UserWarning, match="only 0% of the tree")
        if name == "powersgd_mean"
        else contextlib.nullcontext()
    ):
        specs = jaxsync.state_specs(jax.eval_shape(tx.init, params), AXES)
    state = jax.jit(jax.shard_map(tx.init, mesh=MESH2, in_specs=P(), out_specs=specs))(params)

    def step(g, s):
        return tx.update(jax.tree.map(lambda a: a[0], g), s)

    f = jax.jit(jax.shard_map(step, mesh=MESH2, in_specs=(P(AXES), specs), out_specs=(P(), specs)))
    for t in range(STEPS):
        out, state = f(_grads(t), state)
        if delayed and t == 0:
            want = {"t": np.float32(0.0), "w": np.zeros(3, np.float32)}
        else:
            want = jax.tree.map(lambda a: np.asarray(a).mean(0), _grads(t - 1 if delayed else t))
        for k in want:
            assert out[k].shape == params[k].shape, (name, t, k)
            assert (bits(out[k]) == bits(jnp.asarray(want[k], jnp.float32))).all(), (name, t, k)
    if delayed:  # this step's gradients, each device's own, stacked
        assert state.pending["t"].shape == (N,)
        assert (bits(state.pending["t"]) == bits(_grads(STEPS - 1)["t"])).all()


def test_double_buffering_scalar_pending_under_vmap():
    """Without shard_map too: a scalar's pending gradient is (1,) per replica,
    the update returns the scalar's shape, and the next step applies its mean."""
    g = [{"t": jnp.arange(4.0) + 10 * k} for k in range(2)]
    with pytest.warns(UserWarning, match="double_buffering=True"):
        tx = jaxsync.hierarchical_mean("i", comm=None, double_buffering=True)
    state = jax.vmap(tx.init)(g[0])
    assert state.pending["t"].shape == (4, 1)
    update = jax.vmap(tx.update, axis_name="i")
    out, state = update(g[0], state)
    out, state = update(g[1], state)
    assert out["t"].shape == (4,)
    assert (bits(out["t"]) == bits(jnp.full(4, 1.5))).all()


def test_a_pending_gradient_of_another_shape_names_the_leaf():
    with pytest.warns(UserWarning, match="double_buffering=True"):
        tx = jaxsync.flat_mean(None, comm=None, double_buffering=True)
    state = tx.init({"w": jnp.zeros((8, 3))})
    with pytest.raises(ValueError, match=r"pending gradient of \['w'\] has shape \(8, 3\)") as e:
        jax.eval_shape(tx.update, {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32)}, state)
    assert "needs (2, 3)" in str(e.value) and "state_specs" in str(e.value)


def test_state_specs_refuses_a_scalar_per_replica_leaf():
    """A state whose pending gradient is 0-d (as older jaxsync made it) cannot be
    split by P(axis): state_specs says so, naming the leaf, instead of shard_map."""
    old = jaxsync.DoubleBufferState({"t": jax.ShapeDtypeStruct((), jnp.float32)})
    with pytest.raises(ValueError, match=r"pending\['t'\] is a scalar.*tx\.init"):
        jaxsync.state_specs(old, "d")

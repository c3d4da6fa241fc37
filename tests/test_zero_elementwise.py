"""sharded's elementwise check (issue 46, items 5 and 6): what reads across a
slice is refused whatever the slice's size and whatever the operation (an
allow list), what reads only the step count is accepted, and the error names
the operation that mixes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _common import MESH1
from jax.sharding import PartitionSpec as P

import jaxsync

N = MESH1.size


@pytest.fixture(autouse=True)
def _standard_promotion():
    with jax.numpy_dtype_promotion("standard"):  # optax's bias corrections, schedules
        yield


def _trace(inner, params):
    """Trace (no compile) sharded's step under shard_map over the 8 devices."""
    tx = jaxsync.sharded(inner, axis_name="i", comm=None)
    specs = jaxsync.state_specs(jax.eval_shape(tx.init, params), "i")

    def step(g, state, p):
        return tx.update(jax.tree.map(lambda x, q: x.reshape(q.shape), g, p), state, p)

    init = jax.shard_map(tx.init, mesh=MESH1, in_specs=P(), out_specs=specs)
    run = jax.shard_map(step, mesh=MESH1, in_specs=(P("i"), specs, P()), out_specs=(P(), specs))
    grads = jax.tree.map(lambda x: jnp.concatenate([x.reshape(1, -1)] * N).reshape(-1), params)
    return jax.eval_shape(run, grads, jax.eval_shape(init, params), params)


def _spectral_clip(max_norm):
    """Each matrix scaled to a spectral norm of at most ``max_norm`` (an svd)."""

    def update_fn(updates, state, params=None):
        del params

        def one(u):
            top = jnp.linalg.svd(u.reshape(u.shape[0], -1), compute_uv=False)[0]
            return u * jnp.minimum(1.0, max_norm / top)

        return jax.tree.map(one, updates), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update_fn)


def _decomposition(kind):
    """A made-up transform whose update reads its leaf's (one-element) slice
    through one of linalg's operations or a host callback, and nothing else
    that is not elementwise."""

    def mix(u):
        a = u.reshape(1, 1) + 1.0  # a (1, 1) matrix made of this replica's element
        return {
            "eigh": lambda: jnp.linalg.eigh(a)[0],
            "qr": lambda: jnp.linalg.qr(a)[1],
            "cholesky": lambda: jnp.linalg.cholesky(a),
            "lu": lambda: jax.lax.linalg.lu(a)[0],
            "triangular_solve": lambda: jax.lax.linalg.triangular_solve(a, a, left_side=True),
            "pure_callback": lambda: jax.pure_callback(
                np.negative, jax.ShapeDtypeStruct(a.shape, a.dtype), a
            ),
        }[kind]()

    def update_fn(updates, state, params=None):
        del params
        return jax.tree.map(lambda u: mix(u).reshape(u.shape), updates), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update_fn)


# Every leaf of at most N elements: each replica's slice is one element.
SMALL = {"a": jnp.ones((2, 4)), "b": jnp.ones(5), "c": jnp.ones(())}


def test_a_global_norm_over_one_element_slices_is_refused():
    # Each slice holds one element: optax's norm was a sum over one-element
    # operands, let through, and every replica clipped by its own element's norm.
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))
    with pytest.raises(
        ValueError, match=r"(?s)clip_by_global_norm is not elementwise: its 'reduce_sum'"
    ):
        _trace(inner, SMALL)
    _trace(optax.chain(jaxsync.clip_by_global_norm(1.0), optax.adam(0.1)), SMALL)  # the fix


def test_a_spectral_norm_clip_is_refused_naming_svd():
    inner = optax.chain(_spectral_clip(1.0), optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"(?s)_spectral_clip is not elementwise: its 'svd'"):
        _trace(inner, {"w": jnp.ones((16, 4))})


@pytest.mark.parametrize(
    "kind", ["eigh", "qr", "cholesky", "lu", "triangular_solve", "pure_callback"]
)
def test_decompositions_and_callbacks_on_a_slice_are_refused(kind):
    with pytest.raises(ValueError, match=r"(?s)_decomposition is not elementwise"):
        _trace(_decomposition(kind), {"w": jnp.ones(N)})  # one element a slice


SCHEDULES = {
    "cosine_onecycle": lambda: optax.cosine_onecycle_schedule(20, 0.5),
    "linear_onecycle": lambda: optax.linear_onecycle_schedule(20, 0.5),
    "piecewise_interpolate": lambda: optax.piecewise_interpolate_schedule(
        "cosine", 0.5, {3: 0.5, 6: 2.0}
    ),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_adam_with_a_schedule_of_the_count_runs_and_equals_the_chain(name):
    # These schedules read only the step count (through slices, dot products
    # and stacks of constants): they were refused, named as 'jit'.
    params = {"w": jnp.ones((3, 5)), "c": jnp.arange(7.0)}
    inner = lambda: optax.adam(SCHEDULES[name](), b1=0.5, b2=0.5)
    tx = jaxsync.sharded(inner(), axis_name="i", comm=None)
    chain = optax.chain(jaxsync.hierarchical_mean(axis_name="i", comm=None), inner())
    out = []
    for t in (tx, chain):
        specs = jaxsync.state_specs(jax.eval_shape(t.init, params), "i")
        state = jax.jit(jax.shard_map(t.init, mesh=MESH1, in_specs=P(), out_specs=specs))(params)

        def step(g, st, p, t=t):
            u, st = t.update(jax.tree.map(lambda x, q: x.reshape(q.shape), g, p), st, p)
            return optax.apply_updates(p, u), st

        run = jax.jit(
            jax.shard_map(step, mesh=MESH1, in_specs=(P("i"), specs, P()), out_specs=(P(), specs))
        )
        p = params
        for s in range(5):
            g = {k: (jnp.arange(N * v.size, dtype=jnp.float32) % (7 + s)) - 3 for k, v in p.items()}
            p, state = run(g, state, p)
        out.append(p)
    assert not np.array_equal(out[0]["w"], params["w"])
    for k in params:  # the same arithmetic, fused differently on a slice: a few ulps
        np.testing.assert_allclose(out[0][k], out[1][k], rtol=2e-6, atol=0, err_msg=k)

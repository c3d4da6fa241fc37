"""jaxsync.sharded (ZeRO for optax) in one process: exactness against
``optax.chain(jaxsync.hierarchical_mean(...), inner)``, the refused transforms,
clipping, checkpoints across replica counts, donation, bad input.

Bitwise comparisons use integer-valued gradients and power-of-two
hyperparameters: every product is then exact, so XLA's freedom to contract a
multiply and an add into one fused multiply-add in one fusion and not in
another (it does, between a (3, 2) leaf and its (1, 2) slice) cannot change a
bit. With optax's default hyperparameters and random data the bound is a
tolerance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _common import MESH1, MESH2, bits, raises_then_clean
from _zero_ref import PARAMS, WD_MASK, replica_grads
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxsync

N = 8
STEPS = 20


@pytest.fixture(autouse=True)
def _standard_promotion():
    with jax.numpy_dtype_promotion("standard"):  # optax's bias corrections, schedules
        yield


LABELS = {"b": "plain", "c": "plain", "w": "moment", "k": "moment"}


def _grads(t, n=N):
    """Replica r's integer gradients at step t, the replicas' rows one after another."""
    g = replica_grads(range(n), t)
    return {k: jnp.asarray(v.reshape((-1,) + v.shape[2:])) for k, v in g.items()}


# Power-of-two factors everywhere (see the module's docstring).
INNER = {
    "sgd": lambda: optax.sgd(0.5),
    "momentum": lambda: optax.sgd(0.5, momentum=0.5),
    "nesterov": lambda: optax.sgd(0.5, momentum=0.5, nesterov=True),
    "adam": lambda: optax.adam(0.5, b1=0.5, b2=0.5),
    "adamw_mask": lambda: optax.adamw(0.5, b1=0.5, b2=0.5, weight_decay=0.25, mask=WD_MASK),
    "adamw_ndim_mask": lambda: optax.adamw(
        0.5, b1=0.5, b2=0.5, weight_decay=0.25, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
    ),
    "lion": lambda: optax.lion(0.5, b1=0.5, b2=0.5, weight_decay=0.25),
    "rmsprop": lambda: optax.rmsprop(0.5, decay=0.5),
    "adagrad": lambda: optax.adagrad(0.5),
    "decayed_weights": lambda: optax.chain(optax.add_decayed_weights(0.25), optax.sgd(0.5)),
    "schedule": lambda: optax.sgd(optax.piecewise_constant_schedule(0.5, {5: 0.5, 10: 0.25})),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(
        learning_rate=0.5, b1=0.5, b2=0.5
    ),
    "masked": lambda: optax.chain(optax.masked(optax.sgd(0.25), WD_MASK), optax.sgd(0.5)),
    "multi_transform": lambda: optax.multi_transform(
        {"plain": optax.sgd(0.5), "moment": optax.adam(0.5, b1=0.5, b2=0.5)}, LABELS
    ),
    "clip_jaxsync": lambda: optax.chain(jaxsync.clip_by_global_norm(4.0), optax.sgd(0.5)),
}


def _run_shard_map(tx, mesh, axes, steps=STEPS, params=PARAMS, grads=_grads, n=N, donate=False):
    specs = jaxsync.state_specs(jax.eval_shape(tx.init, params), axes)
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))

    def step(g, state, p):
        u, state = tx.update(_shaped(g, p), state, p)
        return optax.apply_updates(p, u), state

    run = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(axes), specs, P()), out_specs=(P(), specs)),
        donate_argnums=(1, 2) if donate else (),
    )
    state = init(params)
    p = jax.tree.map(jnp.array, params)
    for t in range(steps):
        p, state = run(grads(t, n), state, p)
    return p, state


def _shaped(g, p):
    """A replica's gradients in the parameters' shapes (a scalar's arrives as (1,))."""
    return jax.tree.map(lambda x, q: x.reshape(q.shape), g, p)


def _chain(inner, axes, comm=None):
    return optax.chain(jaxsync.hierarchical_mean(axis_name=axes, comm=comm), inner)


def _same(a, b):
    for k in a:
        np.testing.assert_array_equal(bits(a[k]), bits(b[k]), err_msg=k)


@pytest.mark.parametrize("name", sorted(INNER))
def test_sharded_equals_the_chain_bitwise(name):
    make = INNER[name]
    got, state = _run_shard_map(jaxsync.sharded(make(), axis_name="i", comm=None), MESH1, "i")
    want, _ = _run_shard_map(_chain(make(), "i"), MESH1, "i")
    _same(got, want)
    assert np.isfinite(got["w"]).all() and not np.array_equal(got["w"], PARAMS["w"])


@pytest.mark.parametrize("name", ["adam", "adamw_mask", "multi_transform", "momentum"])
def test_sharded_over_a_mesh_axis_comm(name):
    comm = jaxsync.AxisComm("host")
    tx = jaxsync.sharded(INNER[name](), axis_name="local", comm=comm)
    got, _ = _run_shard_map(tx, MESH2, ("host", "local"))
    want, _ = _run_shard_map(_chain(INNER[name](), "local", comm), MESH2, ("host", "local"))
    _same(got, want)


def test_sharded_default_adam_on_random_data_within_tolerance():
    rng = np.random.default_rng(0)
    data = [
        {k: jnp.asarray(rng.standard_normal(np.shape(v)).astype(np.float32)) for k, v in g.items()}
        for g in (_grads(t) for t in range(STEPS))
    ]
    grads = lambda t, n: data[t]
    got, _ = _run_shard_map(
        jaxsync.sharded(optax.adam(1e-2), axis_name="i", comm=None), MESH1, "i", grads=grads
    )
    want, _ = _run_shard_map(_chain(optax.adam(1e-2), "i"), MESH1, "i", grads=grads)
    for k in got:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_sharded_under_pmap_and_vmap():
    inner = INNER["adam"]
    for mapper in ("pmap", "vmap"):
        got = _mapped(mapper, jaxsync.sharded(inner(), axis_name="i", comm=None))
        want = _mapped(mapper, _chain(inner(), "i"))
        _same(got, want)


def _mapped(mapper, tx):
    """Four steps under pmap or vmap(axis_name="i"); the parameters."""

    def step(g, state, p):
        u, state = tx.update(_shaped(g, p), state, p)
        return optax.apply_updates(p, u), state

    if mapper == "pmap":
        stacked = lambda t: jax.tree.map(lambda x: jnp.stack([x] * N), t)
        init = lambda p: jax.pmap(tx.init, axis_name="i")(stacked(p))
        run = jax.pmap(step, axis_name="i", in_axes=(0, 0, None))
    else:
        init = jax.vmap(tx.init, axis_name="i", in_axes=None, axis_size=N)
        run = jax.jit(jax.vmap(step, axis_name="i", in_axes=(0, 0, None)))
    state = init(PARAMS)
    p = PARAMS
    for t in range(4):
        g = jax.tree.map(
            lambda x: (
                x.reshape((N, -1) + x.shape[1:]).squeeze(1)
                if x.shape[0] == N
                else x.reshape((N, -1) + x.shape[1:])
            ),
            _grads(t),
        )
        out, state = run(g, state, p)
        p = jax.tree.map(lambda x: x[0], out)
    return p


@pytest.mark.parametrize(
    "make, name",
    [
        (
            lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1)),
            "clip_by_global_norm",
        ),
        (lambda: optax.lamb(0.1), "scale_by_trust_ratio"),
        (lambda: optax.lars(0.1), "scale_by_trust_ratio"),
        (lambda: optax.adafactor(0.1), "clip_by_block_rms"),  # adafactor's first
        (
            lambda: optax.chain(optax.clip(1.0), optax.scale_by_trust_ratio()),
            "scale_by_trust_ratio",
        ),
    ],
)
def test_a_transform_that_reads_across_a_leaf_is_refused(make, name):
    tx = jaxsync.sharded(make(), axis_name="i", comm=None)
    with pytest.raises(
        ValueError, match=rf"(?s){name}.*not elementwise.*jaxsync.clip_by_global_norm"
    ):
        _run_shard_map(tx, MESH1, "i", steps=1)


def test_clip_by_global_norm_inside_sharded_matches_optax_on_the_whole_tree():
    inner = lambda clip: optax.chain(clip(3.0), optax.adam(0.5, b1=0.5, b2=0.5))
    got, _ = _run_shard_map(
        jaxsync.sharded(inner(jaxsync.clip_by_global_norm), axis_name="i", comm=None), MESH1, "i"
    )
    want, _ = _run_shard_map(_chain(inner(optax.clip_by_global_norm), "i"), MESH1, "i")
    for k in got:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_clip_by_global_norm_outside_sharded_is_optax_bit_for_bit():
    g = {"a": jnp.arange(12.0).reshape(3, 4), "b": jnp.full((5,), -3.0)}
    for max_norm in (1.0, 100.0):
        mine, theirs = jaxsync.clip_by_global_norm(max_norm), optax.clip_by_global_norm(max_norm)
        a, _ = jax.jit(mine.update)(g, mine.init(g))
        b, _ = jax.jit(theirs.update)(g, theirs.init(g))
        _same(a, b)
    with pytest.raises(ValueError, match="max_norm must be a positive number"):
        jaxsync.clip_by_global_norm(0.0)


def _skip_on_nan(updates, gradient_step, params):
    """A traced predicate: MultiSteps's lax.cond is traced, not folded."""
    del gradient_step, params
    return jnp.any(jnp.isnan(updates["w"])), ()


def _multisteps_shard_map(tx, steps=4):
    """The quickstart's step (params replicated, each device's batch; the gradients
    from jax.grad, summed over the axis by autodiff) with ``tx`` under shard_map."""
    specs = jaxsync.state_specs(jax.eval_shape(tx.init, PARAMS), "i")

    def step(p, state, x):
        loss = lambda p: jnp.sum((x @ p["w"] + p["b"] - 1.0) ** 2) + jnp.sum(p["c"] ** 2)
        u, state = tx.update(jax.grad(loss)(p), state, p)
        return optax.apply_updates(p, u), state

    run = jax.jit(
        jax.shard_map(step, mesh=MESH1, in_specs=(P(), specs, P("i")), out_specs=(P(), specs))
    )
    state = jax.jit(jax.shard_map(tx.init, mesh=MESH1, in_specs=P(), out_specs=specs))(PARAMS)
    p = PARAMS
    x = jnp.arange(N * 2 * 3, dtype=jnp.float32).reshape(N * 2, 3) / 8
    for _ in range(steps):
        p, state = run(p, state, x)
    return p


@pytest.mark.parametrize("mapper", ["pmap", "vmap", "shard_map"])
def test_multisteps_around_sharded(mapper):
    # Under vmap, MultiSteps's jax.eval_shape of the update traced sharded's
    # all-gather unbatched, and JAX's invariant all-gather failed an assertion on
    # the vmap axis (an AssertionError naming ManualAxisType).
    inner = INNER["adam"]
    tx = optax.MultiSteps(
        jaxsync.sharded(inner(), axis_name="i", comm=None), 2, should_skip_update_fn=_skip_on_nan
    )
    chain = optax.MultiSteps(_chain(inner(), "i"), 2, should_skip_update_fn=_skip_on_nan)
    if mapper == "shard_map":
        got, want = _multisteps_shard_map(tx), _multisteps_shard_map(chain)
    else:
        got, want = _mapped(mapper, tx), _mapped(mapper, chain)
    assert not np.array_equal(got["w"], PARAMS["w"])  # two updates applied
    if mapper != "vmap":
        _same(got, want)
        return
    # One program for every replica: XLA fuses the whole tree's accumulation and
    # the slices' differently (seen: 1 ulp in one element of 7).
    for k in got:
        np.testing.assert_array_max_ulp(np.asarray(got[k]), np.asarray(want[k]), maxulp=1)


def test_state_is_one_nth_per_device():
    tx = jaxsync.sharded(optax.adam(0.1), axis_name="i", comm=None)
    _, state = _run_shard_map(tx, MESH1, "i", steps=1)
    chained = _chain(optax.adam(0.1), "i").init(PARAMS)
    for k, p in PARAMS.items():
        mu = state.inner[0].mu[k]
        k_len = -(-int(np.prod(p.shape)) // N)
        assert mu.shape[0] == N and mu.size == N * k_len
        per_device = mu.addressable_shards[0].data.nbytes
        assert per_device == 4 * k_len < chained[1][0].mu[k].nbytes or p.size <= 1


def _same_grads(t, n):
    """Every replica with replica 0's gradients: the mean does not depend on n."""
    return jax.tree.map(lambda x: jnp.concatenate([x[: x.shape[0] // N]] * n), _grads(t))


def _steps(tx, n, steps, start=0, state=None, params=PARAMS):
    """Steps ``start..start+steps`` of ``tx`` on ``n`` devices (same gradients)."""
    mesh = Mesh(np.array(jax.devices()[:n]), ("i",))
    shapes = jax.eval_shape(tx.init, params) if state is None else state
    specs = jaxsync.state_specs(shapes, "i")

    def step(g, st, p):
        u, st = tx.update(_shaped(g, p), st, p)
        return optax.apply_updates(p, u), st

    run = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P("i"), specs, P()), out_specs=(P(), specs))
    )
    if state is None:
        state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    else:
        state = jax.device_put(state, jax.tree.map(lambda s: jax.NamedSharding(mesh, s), specs))
    p = jax.device_get(params)
    for t in range(start, start + steps):
        p, state = run(_same_grads(t, n), state, p)
    return jax.device_get(p), state


@pytest.mark.parametrize("before, after", [(2, 3), (3, 2)])
def test_checkpoint_round_trip_across_replica_counts(before, after):
    # reduce="sum": no division by 3, which XLA may turn into a multiplication
    # by 1/3 fused differently in each program (an ULP apart).
    inner = INNER["adam"]
    sharded = lambda: jaxsync.sharded(inner(), axis_name="i", comm=None, reduce="sum")
    chain = lambda: optax.chain(
        jaxsync.hierarchical_mean(axis_name="i", comm=None, reduce="sum"), inner()
    )
    p, state = _steps(sharded(), before, 10)
    cp, cstate = _steps(chain(), before, 10)
    _same(p, cp)
    whole = jaxsync.gather_state(inner(), jax.device_get(state), PARAMS)
    # The whole state equals the chain's (its inner part), bit for bit.
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(jax.device_get(cstate[1]))):
        np.testing.assert_array_equal(bits(a), bits(b))
    resharded = jaxsync.shard_state(inner(), whole, PARAMS, replicas=after)
    got, _ = _steps(sharded(), after, 10, start=10, state=resharded, params=p)
    want, _ = _steps(chain(), after, 10, start=10, state=jax.device_get(cstate), params=cp)
    _same(got, want)


def test_params_and_state_donated():
    tx = jaxsync.sharded(INNER["adam"](), axis_name="i", comm=None)
    got, _ = _run_shard_map(tx, MESH1, "i", steps=3, donate=True)
    want, _ = _run_shard_map(_chain(INNER["adam"](), "i"), MESH1, "i", steps=3)
    _same(got, want)


def test_a_state_from_another_world_size_or_tree_is_refused():
    tx8 = jaxsync.sharded(INNER["adam"](), axis_name="i", comm=None)
    _, state8 = _steps(tx8, 8, 1)
    with pytest.raises(
        ValueError, match=r"(?s)state leaf .*has shape \(2,.*expected \(1,.*shard_state"
    ):
        _steps(tx8, 4, 1, state=jax.device_get(state8))  # 8 replicas' slices on 4
    other = dict(PARAMS, extra=jnp.ones(3))
    tx = jaxsync.sharded(optax.adam(0.1), axis_name="i", comm=None)
    with pytest.raises(ValueError, match="another tree"):
        jax.vmap(lambda g: tx.update(g, tx.init(PARAMS), PARAMS), axis_name="i")(
            jax.tree.map(lambda x: jnp.stack([x] * 2), other)
        )
    with pytest.raises(TypeError, match="expected ShardedState"):
        jax.vmap(lambda g: tx.update(g, optax.EmptyState()), axis_name="i")(
            jax.tree.map(lambda x: jnp.stack([x] * 2), PARAMS)
        )


def test_bad_arguments_are_refused_when_the_factory_is_called():
    with pytest.raises(TypeError, match="inner must be an optax GradientTransformation"):
        jaxsync.sharded("adam", axis_name="i")
    with pytest.raises(ValueError, match="reduce"):
        jaxsync.sharded(optax.sgd(0.1), axis_name="i", comm=None, reduce="max")
    tx = jaxsync.sharded(optax.sgd(0.1), axis_name="i", comm=None)
    with pytest.raises(TypeError, match=r"leaf \['n'\] is of dtype int32.*eqx.filter"):
        jax.vmap(tx.init, axis_name="i", in_axes=None, axis_size=2)({"n": jnp.arange(3)})


def test_check_finite_and_reduce_sum_and_comm_dtype():
    def grads(t, n):
        g = _grads(t, n)
        if t == 1:
            g["c"] = g["c"].at[3].set(jnp.nan)
        return g

    tx = jaxsync.sharded(optax.sgd(0.5), axis_name="i", comm=None, check_finite=True)
    specs = jaxsync.state_specs(jax.eval_shape(tx.init, PARAMS), "i")
    state = jax.jit(jax.shard_map(tx.init, mesh=MESH1, in_specs=P(), out_specs=specs))(PARAMS)
    upd = jax.jit(
        jax.shard_map(tx.update, mesh=MESH1, in_specs=(P("i"), specs, P()), out_specs=(P(), specs))
    )
    flags = []
    for t in range(3):
        _, state = upd(grads(t, N), state, PARAMS)
        flags.append(bool(state.all_finite))
    assert flags == [True, False, True]
    raising = jaxsync.sharded(optax.sgd(0.5), axis_name="i", comm=None, check_finite="raise")
    specs_r = jaxsync.state_specs(jax.eval_shape(raising.init, PARAMS), "i")
    st = jax.jit(jax.shard_map(raising.init, mesh=MESH1, in_specs=P(), out_specs=specs_r))(PARAMS)
    f = jax.jit(
        jax.shard_map(
            raising.update, mesh=MESH1, in_specs=(P("i"), specs_r, P()), out_specs=(P(), specs_r)
        )
    )
    raises_then_clean(
        lambda: f(grads(1, N), st, PARAMS),
        lambda: f(grads(0, N), st, PARAMS),
        match=r"non-finite .* \['c'\]",
    )
    for opts in ({"reduce": "sum"}, {"comm_dtype": jnp.bfloat16}):
        got, _ = _run_shard_map(
            jaxsync.sharded(optax.sgd(0.5), axis_name="i", comm=None, **opts), MESH1, "i", steps=3
        )
        chain = optax.chain(
            jaxsync.hierarchical_mean(axis_name="i", comm=None, **opts), optax.sgd(0.5)
        )
        want, _ = _run_shard_map(chain, MESH1, "i", steps=3)
        _same(got, want)

"""Skipping non-finite steps on every replica at once, gradient accumulation
with one synchronisation per ``k`` micro-steps, and extra arguments through
``sharded``: in one process, under ``shard_map`` with per-device gradients
(8 devices) and ``vmap``. The multi-process checks (where optax's own
recipes hang) are ``tests/mpi/test_finite_mpi.py``.

Values are small integers and halves (dyadic): the means and sgd(1.0) steps
are exact, so results are compared bitwise against closed forms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxsync

N = 8
MESH = Mesh(np.array(jax.devices()[:N]), ("d",))
PARAMS = {"b": jnp.zeros(()), "w": jnp.zeros((2, 3))}


@pytest.fixture(autouse=True)
def _standard_promotion():
    with jax.numpy_dtype_promotion("standard"):  # optax's counters and schedules
        yield


def _grads(t, bad=None):
    """Replica r's gradients at step t (r + t + j), stacked along axis 0; with
    ``bad=r`` replica r's "w" holds a NaN."""
    r = np.arange(N, dtype=np.float32)
    g = {
        "b": r + t,
        "w": (r[:, None, None] + t + np.arange(6, dtype=np.float32).reshape(1, 2, 3)),
    }
    if bad is not None:
        g["w"][bad, 1, 2] = np.nan
    return {"b": jnp.asarray(g["b"]), "w": jnp.asarray(g["w"].reshape(N * 2, 3))}


def _mean(t):
    """The mean over the replicas of ``_grads(t)``: (N - 1) / 2 + t (+ j)."""
    m = (N - 1) / 2 + t
    return {"b": np.float32(m), "w": (m + np.arange(6, dtype=np.float32)).reshape(2, 3)}


def _run(tx, steps, state_spec=None):
    """Run ``tx`` under shard_map for ``steps`` (list of (t, bad)); returns the
    params after each step and the last state."""
    shapes = jax.eval_shape(tx.init, PARAMS)
    specs = jaxsync.state_specs(shapes, "d") if state_spec is None else state_spec
    state = jax.jit(jax.shard_map(tx.init, mesh=MESH, in_specs=P(), out_specs=specs))(PARAMS)

    def step(g, s, p):
        g = {"b": g["b"][0], "w": g["w"]}
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    run = jax.jit(
        jax.shard_map(step, mesh=MESH, in_specs=(P("d"), specs, P()), out_specs=(P(), specs))
    )
    params, out = PARAMS, []
    for t, bad in steps:
        params, state = run(_grads(t, bad), state, params)
        out.append(jax.device_get(params))
    return out, state


def _sgd_closed_form(steps):
    """sgd(1.0) on the replica mean, skipping the steps with a NaN."""
    p = {k: np.zeros(v.shape, np.float32) for k, v in PARAMS.items()}
    out = []
    for t, bad in steps:
        if bad is None:
            p = {k: p[k] - _mean(t)[k] for k in p}
        out.append(dict(p))
    return out


def _same(got, want):
    for g, w in zip(got, want, strict=True):
        for k in w:
            np.testing.assert_array_equal(np.asarray(g[k]), w[k], err_msg=k)


STEPS = [(0, None), (1, 3), (2, None), (3, 0)]


def test_apply_if_finite_around_a_chain_skips_on_every_device_under_shard_map():
    # optax.apply_if_finite(chain) does not trace here (cond branches' types);
    # jaxsync's decides on the count over every replica and runs the chain always.
    sync = jaxsync.hierarchical_mean(axis_name="d", comm=None)
    tx = jaxsync.apply_if_finite(optax.chain(sync, optax.sgd(1.0)), 2, axis_name="d", comm=None)
    got, state = _run(tx, STEPS)
    _same(got, _sgd_closed_form(STEPS))
    assert int(state.notfinite_count) == 1 and int(state.total_notfinite) == 2
    assert not bool(state.last_finite)


def test_the_documented_chain_recipe_traces_and_skips_under_shard_map():
    # The mean first, outside any decision; optax's apply_if_finite after it
    # decides on the mean, the same on every replica.
    sync = jaxsync.hierarchical_mean(axis_name="d", comm=None)
    tx = optax.chain(sync, optax.apply_if_finite(optax.sgd(1.0), 2))
    got, _ = _run(tx, STEPS)
    _same(got, _sgd_closed_form(STEPS))


@pytest.mark.parametrize("check_finite", [True, False], ids=["all_finite", "count"])
def test_apply_if_finite_around_sharded_skips_on_every_device(check_finite):
    inner = optax.sgd(1.0, momentum=0.5)
    sh = jaxsync.sharded(inner, axis_name="d", comm=None, check_finite=check_finite)
    tx = jaxsync.apply_if_finite(sh, 3, axis_name="d", comm=None)
    got, state = _run(tx, STEPS)
    # momentum 0.5 on the accepted steps only: trace = g + trace / 2
    p, tr, want = 0.0, 0.0, []
    for t, bad in STEPS:
        if bad is None:
            tr = _mean(t)["b"] + 0.5 * tr
            p = p - tr
        want.append(p)
    assert [float(x["b"]) for x in got] == want
    assert int(state.total_notfinite) == 2


def test_skip_not_finite_drops_a_micro_step_on_every_replica():
    sync = jaxsync.hierarchical_mean(axis_name="i", comm=None)
    skip = jaxsync.skip_not_finite(axis_name="i", comm=None)
    tx = optax.MultiSteps(optax.chain(sync, optax.sgd(1.0)), 2, should_skip_update_fn=skip)
    params = jax.tree.map(lambda x: jnp.broadcast_to(x, (N, *x.shape)), PARAMS)
    state = jax.vmap(tx.init)(params)
    upd = jax.jit(jax.vmap(tx.update, axis_name="i"))
    plain = {"b": np.zeros(N, np.float32)}
    for t, bad in [(0, None), (1, 5), (2, None), (3, None)]:
        g = _grads(t, bad)
        g = {"b": g["b"], "w": g["w"].reshape(N, 2, 3)}
        u, state = upd(g, state, params)
        params = optax.apply_updates(params, u)
        steps = np.asarray(state.mini_step)
        assert (steps == steps[0]).all()
    # accepted micro-steps 0, 2 | 3 (boundary moved by one): one update of mean(t=0, 2)
    np.testing.assert_array_equal(np.asarray(params["b"]), plain["b"] - (3.5 + 1.0))
    np.testing.assert_array_equal(np.asarray(state.mini_step), np.ones(N, np.int32))


def test_accumulate_syncs_once_per_k_and_equals_the_closed_form_and_multisteps():
    k = 4
    sync = jaxsync.hierarchical_mean(axis_name="d", comm=None)
    tx = jaxsync.accumulate(optax.chain(sync, optax.sgd(1.0)), k, axis_name="d")
    steps = [(t, None) for t in range(2 * k)]
    got, state = _run(tx, steps)
    want, p = [], 0.0
    for t, _ in steps:
        if t % k == k - 1:  # mean over the k micro-steps of (N - 1) / 2 + t
            p = p - np.mean([_mean(s)["b"] for s in range(t - k + 1, t + 1)])
        want.append(p)
    assert [float(x["b"]) for x in got] == want
    assert int(state.mini_step) == 0
    # MultiSteps around the same chain (it syncs every micro-step) agrees bitwise,
    # run under vmap (its cond does not type-check varying gradients under shard_map).
    ms = optax.MultiSteps(optax.chain(jaxsync.hierarchical_mean("i", comm=None), optax.sgd(1.0)), k)
    acc = jaxsync.accumulate(
        optax.chain(jaxsync.hierarchical_mean("i", comm=None), optax.sgd(1.0)), k, axis_name="i"
    )
    outs = []
    for t_ in (ms, acc):
        ps = jax.tree.map(lambda x: jnp.broadcast_to(x, (N, *x.shape)), PARAMS)
        st = jax.vmap(t_.init)(ps)
        upd = jax.jit(jax.vmap(t_.update, axis_name="i"))
        for t in range(2 * k):
            g = _grads(t)
            u, st = upd({"b": g["b"], "w": g["w"].reshape(N, 2, 3)}, st, ps)
            ps = optax.apply_updates(ps, u)
        outs.append(jax.device_get(ps))
    for key in PARAMS:
        np.testing.assert_array_equal(outs[0][key], outs[1][key])
    np.testing.assert_array_equal(outs[1]["b"], np.full(N, want[-1], np.float32))


def test_accumulate_runs_the_sync_only_in_the_kth_branch():
    # The jaxpr's collectives: none outside the lax.cond.
    sync = jaxsync.hierarchical_mean(axis_name="i", comm=None)
    tx = jaxsync.accumulate(optax.chain(sync, optax.sgd(1.0)), 3, axis_name="i")
    g = jnp.ones((N, 5))
    jaxpr = jax.make_jaxpr(jax.vmap(lambda x: tx.update(x, tx.init(x))[0], axis_name="i"))(g)
    names = [e.primitive.name for e in jaxpr.jaxpr.eqns]
    assert "cond" in names and not any(n.startswith("psum") for n in names)
    assert "psum" in str(jaxpr)  # inside the branch


def test_accumulate_validates_every():
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        jaxsync.accumulate(optax.sgd(1.0), 0, axis_name=None)
    with pytest.raises(ValueError, match="max_consecutive_errors"):
        jaxsync.apply_if_finite(optax.sgd(1.0), -1, axis_name=None, comm=None)


def test_sharded_forwards_extra_args_to_reduce_on_plateau():
    # The value must be the same on every replica: the mean of the replicas' losses.
    plateau = optax.contrib.reduce_on_plateau(factor=0.5, patience=1, accumulation_size=1)
    inner = optax.chain(optax.sgd(1.0), plateau)
    tx = jaxsync.sharded(inner, axis_name="d", comm=None)
    chained = optax.chain(jaxsync.hierarchical_mean(axis_name="d", comm=None), inner)
    got = []
    for t_ in (tx, chained):
        shapes = jax.eval_shape(t_.init, PARAMS)
        specs = jaxsync.state_specs(shapes, "d")
        st = jax.jit(jax.shard_map(t_.init, mesh=MESH, in_specs=P(), out_specs=specs))(PARAMS)

        def step(g, loss, s, p, t_=t_):
            value = jaxsync.replica_mean(loss[0], axis_name="d", comm=None)
            u, s = t_.update({"b": g["b"][0], "w": g["w"]}, s, p, value=value)
            return optax.apply_updates(p, u), s

        run = jax.jit(
            jax.shard_map(
                step, mesh=MESH, in_specs=(P("d"), P("d"), specs, P()), out_specs=(P(), specs)
            )
        )
        ps, trail = PARAMS, []
        for _ in range(4):  # a constant loss: the scale halves after patience
            ps, st = run(_grads(0), jnp.full((N,), 2.0), st, ps)
            trail.append(float(ps["b"]))
        got.append(trail)
    assert got[0] == got[1]
    # 3.5 a step, then the scale halves at each step without improvement
    assert got[0] == [-3.5, -3.5 - 1.75, -3.5 - 1.75 - 0.875, -3.5 - 1.75 - 0.875 - 0.4375]


def test_sharded_accumulate_is_zero2_exact_and_gathers_every_kth_call():
    k = 4
    inner = optax.sgd(1.0, momentum=0.5)
    tx = jaxsync.sharded(inner, axis_name="d", comm=None, accumulate=k)
    steps = [(t, None) for t in range(2 * k)]
    got, state = _run(tx, steps)
    p, tr, want = 0.0, 0.0, []
    for t, _ in steps:
        if t % k == k - 1:
            tr = np.mean([_mean(s)["b"] for s in range(t - k + 1, t + 1)]) + 0.5 * tr
            p = p - tr
        want.append(p)
    assert [float(x["b"]) for x in got] == want
    # the whole "w" leaf (6 elements) too, and the same as a local accumulation
    ref, _ = _run(
        jaxsync.accumulate(jaxsync.sharded(inner, axis_name="d", comm=None), k, axis_name="d"),
        steps,
    )
    for g, r in zip(got, ref):
        np.testing.assert_array_equal(g["w"], r["w"])
    # the accumulator is this replica's 1/N slice: 6 elements -> 1 per device
    acc = state.inner.acc["w"]
    assert acc.addressable_shards[0].data.size == 1 and int(state.inner.mini_step) == 0
    # the all-gather only in the k-th call's branch, the reduce-scatter every call
    specs = jaxsync.state_specs(jax.eval_shape(tx.init, PARAMS), "d")
    f = jax.shard_map(
        lambda g, s: tx.update({"b": g["b"][0], "w": g["w"]}, s)[0],
        mesh=MESH,
        in_specs=(P("d"), specs),
        out_specs=P(),
    )
    jaxpr = jax.make_jaxpr(f)(_grads(0), state).jaxpr.eqns[0].params["jaxpr"]
    top = [e.primitive.name for e in jaxpr.eqns]
    (cond,) = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
    inside = [e.primitive.name for b in cond.params["branches"] for e in b.jaxpr.eqns]
    assert "reduce_scatter" in top and not any("all_gather" in n for n in top), top
    assert any("all_gather" in n for n in inside), inside


def test_sharded_accumulate_drops_a_non_finite_micro_step_with_apply_if_finite():
    k = 2
    sh = jaxsync.sharded(optax.sgd(1.0), axis_name="d", comm=None, check_finite=True, accumulate=k)
    tx = jaxsync.apply_if_finite(sh, 3, axis_name="d", comm=None)
    got, _ = _run(tx, [(0, None), (1, 4), (2, None), (3, None), (4, None)])
    # micro-steps 0, (1 dropped on every device), 2 | 3, 4
    first = -(_mean(0)["b"] + _mean(2)["b"]) / 2
    second = first - (_mean(3)["b"] + _mean(4)["b"]) / 2
    assert [float(x["b"]) for x in got] == [0.0, 0.0, first, first, second]

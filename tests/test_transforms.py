"""Tests of the public optax factories and ``sync_gradients`` (jaxsync/_core/_transforms.py).

Reliability rows (the table in tests/_common.py) covered: 5 (float0 leaves), 6 (unbound axis,
outside any mapped
context), 7 (bad arguments), 8 (wrong state), 16 (f16 overflow and predivide),
17 (NaN/Inf on one replica, check_finite), 18 (eager == jit), plus training
parity with single-device optax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _common import HL, INTER, MESH1, MESH2, STRATEGIES, N, bits, raises_then_clean  # noqa: E402
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsync

FACTORIES = {s: getattr(jaxsync, f"{s}_mean") for s in STRATEGIES}


def make_tx(strategy, layout="i", **opts):
    if layout == "axiscomm":
        return FACTORIES[strategy](axis_name="local", comm=jaxsync.AxisComm("host"), **opts)
    if strategy == "single_node":
        return FACTORIES[strategy](axis_name="i", **opts)
    return FACTORIES[strategy](axis_name="i", comm=None, **opts)


def apply(tx, g):
    return tx.update(g, tx.init(g))[0]


def on_mesh(fn, layout="shard_map", jit=True):
    """Per-replica ``fn`` over leaves with a leading replica axis of size 8."""
    mesh, spec = (MESH2, P(HL)) if layout == "axiscomm" else (MESH1, P("i"))

    def per_device(tree):
        return jax.tree.map(lambda x: x[None], fn(jax.tree.map(lambda x: x[0], tree)))

    f = jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec)
    return jax.jit(f) if jit else f


# ----------------------------------------------------------------------------
# factories and states
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_factories_return_stateless_gradient_transformations(strategy):
    tx = make_tx(strategy)
    assert isinstance(tx, optax.GradientTransformation)
    state = tx.init({"w": jnp.ones(3)})
    assert isinstance(state, optax.EmptyState)
    out = jax.vmap(lambda g: tx.update(g, tx.init(g)), axis_name="i")({"w": jnp.ones((N, 3))})
    assert isinstance(out[1], optax.EmptyState)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_check_finite_state_is_sync_state(strategy):
    tx = make_tx(strategy, check_finite=True)
    state = tx.init({"w": jnp.ones(3)})
    assert isinstance(state, jaxsync.SyncState)
    assert state.all_finite.dtype == jnp.bool_ and state.all_finite.shape == ()
    assert bool(state.all_finite)


def test_factory_names_and_sync_gradients_default_strategy():
    for s, fac in FACTORIES.items():
        assert fac.__name__ == f"{s}_mean"
    g = {"w": jnp.arange(N, dtype=jnp.float32)}
    out = jax.vmap(lambda t: jaxsync.sync_gradients(t, axis_name="i", comm=None), axis_name="i")(g)
    assert np.array_equal(np.asarray(out["w"]), np.full(N, 3.5, np.float32))


# Every public callable taking options spells them out: explicit keyword arguments
# with a type and a default (what IDEs, help() and type checkers show), and an
# optax-style docstring (Args / Returns / Example).
PUBLIC_FUNCTIONS = sorted(
    name for name in jaxsync.__all__ if __import__("inspect").isfunction(getattr(jaxsync, name))
)


def test_the_signature_check_sees_every_public_function():
    # It was a hand-written list, which the functions added since (all_done,
    # accumulate, diloco, shard_state, ...) never joined.
    assert {"all_done", "accumulate", "diloco", "shard_state", "save_tree_spec"} <= set(
        PUBLIC_FUNCTIONS
    )


@pytest.mark.parametrize("name", PUBLIC_FUNCTIONS)
def test_public_signatures_are_explicit_and_typed(name):
    import inspect

    fn = getattr(jaxsync, name)
    sig = inspect.signature(fn)
    kinds = {p.kind for p in sig.parameters.values()}
    assert inspect.Parameter.VAR_KEYWORD not in kinds, f"{name} takes **kwargs"
    assert inspect.Parameter.VAR_POSITIONAL not in kinds, f"{name} takes *args"
    untyped = [p.name for p in sig.parameters.values() if p.annotation is p.empty]
    assert not untyped, f"{name}: parameters without a type: {untyped}"
    assert sig.return_annotation is not sig.empty, f"{name}: no return type"
    doc = inspect.getdoc(fn) or ""
    for part in (["Args:"] if sig.parameters else []) + ["Returns:", "Example:"]:
        assert part in doc, f"{name}'s docstring has no {part!r} section"


# ----------------------------------------------------------------------------
# row 17: NaN/Inf on one replica; check_finite
# ----------------------------------------------------------------------------


def nonfinite_tree():
    a = np.tile(np.arange(4, dtype=np.float32), (N, 1))
    a[3, 1] = np.nan  # NaN on replica 3 only
    b = np.ones((N, 3), np.float32)
    b[5, 0], b[6, 0] = np.inf, -np.inf  # +inf and -inf on two replicas -> NaN
    b[2, 2] = np.inf  # +inf on one replica -> inf
    c = np.ones((N, 2), np.float32)  # all finite
    return {"a": jnp.asarray(a), "b": jnp.asarray(b, jnp.bfloat16), "c": jnp.asarray(c)}


@pytest.mark.parametrize(
    "layout,strategies",
    [("shard_map", STRATEGIES), ("axiscomm", INTER)],
    ids=["shard_map", "axiscomm"],
)
def test_nonfinite_on_one_replica_same_result_everywhere(layout, strategies):
    txs = {
        s: make_tx(s, "axiscomm" if layout == "axiscomm" else "i", check_finite=True)
        for s in strategies
    }

    def step(g):
        out = {}
        for s, tx in txs.items():
            res, state = tx.update(g, tx.init(g))
            out[s] = (res, state.all_finite[None])
        return out

    outs = on_mesh(step, layout)(nonfinite_tree())
    for s in strategies:
        res, finite = outs[s]
        for name, leaf in res.items():
            for r in range(1, N):
                assert np.array_equal(bits(leaf[r]), bits(leaf[0])), (
                    f"{s}/{name}: replica {r} differs from replica 0"
                )
        a = np.asarray(res["a"][0])
        assert np.isnan(a[1]) and np.array_equal(a[[0, 2, 3]], [0, 2, 3]), f"{s}: a = {a}"
        b = np.asarray(res["b"][0]).astype(np.float32)
        assert np.isnan(b[0]) and b[1] == 1 and b[2] == np.inf, f"{s}: b = {b}"
        assert np.array_equal(np.asarray(res["c"]), np.ones((N, 2), np.float32))
        assert not np.any(np.asarray(finite)), f"{s}: all_finite should be False everywhere"


def test_check_finite_true_usable_in_optax_chain():
    tx = optax.chain(jaxsync.flat_mean(axis_name="i", comm=None, check_finite=True), optax.sgd(1.0))
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    assert isinstance(state[0], jaxsync.SyncState)

    @jax.jit
    def step(grads, state):
        return jax.vmap(lambda g: tx.update(g, state, params), axis_name="i")(grads)

    good = {"w": jnp.tile(jnp.arange(N, dtype=jnp.float32)[:, None], (1, 2))}
    updates, new_state = step(good, state)
    assert np.array_equal(np.asarray(updates["w"]), np.full((N, 2), -3.5, np.float32))
    assert np.asarray(new_state[0].all_finite).tolist() == [True] * N
    bad = {"w": good["w"].at[4, 1].set(jnp.inf)}
    _, new_state = step(bad, state)
    assert np.asarray(new_state[0].all_finite).tolist() == [False] * N


RAISE_LAYOUTS = ["vmap_eager", "vmap_jit", "pmap", "shard_map"]


def _raise_fn(layout):
    tx = jaxsync.flat_mean(axis_name="i", comm=None, check_finite="raise")
    f = lambda g: apply(tx, g)
    if layout == "vmap_eager":
        return jax.vmap(f, axis_name="i")
    if layout == "vmap_jit":
        return jax.jit(jax.vmap(f, axis_name="i"))
    if layout == "pmap":
        return jax.pmap(f, axis_name="i")
    return on_mesh(f)


@pytest.mark.parametrize("layout", RAISE_LAYOUTS)
def test_check_finite_raise_names_the_leaf(layout):
    fn = _raise_fn(layout)
    good = {"ok": jnp.ones((N, 2)), "nested": {"bad": jnp.ones((N, 3))}}
    jax.block_until_ready(fn(good))  # no error on finite data
    bad = {"ok": jnp.ones((N, 2)), "nested": {"bad": good["nested"]["bad"].at[3, 1].set(jnp.nan)}}
    msg = str(raises_then_clean(lambda: fn(bad), lambda: fn(good)))
    assert "['nested']['bad']" in msg, msg[-500:]
    assert "['ok']" not in msg


# ----------------------------------------------------------------------------
# row 16: f16 overflow and predivide
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_predivide_keeps_f16_finite(strategy):
    """Replica values 30000 on 8 replicas: the sum 240000 exceeds float16's 65504.

    What the library does (and documents: 16-bit partial sums are accumulated in
    float32 but *rounded back to 16 bits before the division by n*): with
    predivide=1.0 (off) the f16 mean is inf; with the default (predivide=None,
    which divides float16 data by n before the sum), with predivide=8 and with
    float32 transport it is exactly 30000.
    """
    cases = {
        "f16": (jnp.float16, None),
        "f32_over_f16": (jnp.float32, jnp.float16),
        "f32": (jnp.float32, None),
    }
    txs = {
        (c, p): make_tx(strategy, comm_dtype=cd, predivide=p)
        for c, (_, cd) in cases.items()
        for p in (None, 1.0, 8.0)
    }
    tree = {c: jnp.full((N, 5), 30000, dt) for c, (dt, _) in cases.items()}

    def step(g):
        return {f"{c}/{p}": apply(tx, {"x": g[c]})["x"] for (c, p), tx in txs.items()}

    out = on_mesh(step)(tree)
    for c, (dt, _) in cases.items():
        for p in (None, 1.0, 8.0):
            got = out[f"{c}/{p}"]
            assert got.dtype == dt
            vals = np.asarray(got, np.float32)
            if c != "f32" and p == 1.0:
                assert np.all(np.isposinf(vals)), (
                    f"{c}: default f16 transport no longer overflows - update this test/docs"
                )
            else:
                assert np.array_equal(vals, np.full((N, 5), 30000, np.float32)), f"{c}/{p}: {vals}"


@pytest.mark.parametrize("predivide", [2.0, 8.0, 3.0])
def test_predivide_does_not_change_the_f32_mean(predivide):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((N, 16)), jnp.float32)
    tx = jaxsync.hierarchical_mean(axis_name="i", comm=None, predivide=predivide)
    got = np.asarray(on_mesh(lambda g: apply(tx, g))(x), np.float64)
    ref = np.asarray(x, np.float64).mean(0)
    # two extra roundings (x / p, then sum / (n / p)) on top of the 8-ULP sum bound
    M = np.abs(np.asarray(x)).max(0)
    assert np.all(np.abs(got - ref) <= 10 * np.spacing(M.astype(np.float32)))
    if predivide in (2.0, 8.0):  # powers of two: exactly the plain mean
        plain = on_mesh(lambda g: apply(jaxsync.hierarchical_mean(axis_name="i", comm=None), g))(x)
        assert np.array_equal(bits(np.asarray(got, np.float32)), bits(plain))


# ----------------------------------------------------------------------------
# row 7: bad arguments, at factory time, naming the argument
# ----------------------------------------------------------------------------

BAD_ARGS = [
    # (id, kwargs, exception, words the message must contain)
    ("axis_list", dict(axis_name=["i"]), TypeError, ["axis_name", "tuple", "list"]),
    ("axis_bool", dict(axis_name=True), TypeError, ["axis_name", "bool"]),
    ("axis_float", dict(axis_name=1.5), TypeError, ["axis_name", "float"]),
    ("axis_tuple_of_list", dict(axis_name=("i", ["j"])), TypeError, ["axis_name"]),
    ("axis_repeated", dict(axis_name=("i", "i")), ValueError, ["axis_name", "repeats"]),
    ("reduce_max", dict(reduce="max"), ValueError, ["reduce", "'max'", "mean", "sum"]),
    ("bucket_0", dict(bucket_bytes=0), ValueError, ["bucket_bytes", "0"]),
    ("bucket_neg", dict(bucket_bytes=-1), ValueError, ["bucket_bytes", "-1"]),
    ("bucket_str", dict(bucket_bytes="1"), TypeError, ["bucket_bytes", "str"]),
    ("bucket_float", dict(bucket_bytes=1e6), TypeError, ["bucket_bytes", "float"]),
    ("threshold_neg", dict(pack_threshold=-4), ValueError, ["pack_threshold"]),
    ("comm_str", dict(comm="x"), TypeError, ["comm", "'x'", "AxisComm"]),
    ("comm_int", dict(comm=3), TypeError, ["comm", "int"]),
    ("comm_dtype_int", dict(comm_dtype=jnp.int32), ValueError, ["comm_dtype", "int32"]),
    ("comm_dtype_foo", dict(comm_dtype="foo"), TypeError, ["comm_dtype", "foo"]),
    ("comm_dtype_complex", dict(comm_dtype=jnp.complex64), ValueError, ["comm_dtype"]),
    ("predivide_half", dict(predivide=0.5), ValueError, ["predivide", "0.5"]),
    ("predivide_array", dict(predivide=jnp.array(2.0)), TypeError, ["predivide"]),
    ("predivide_bool", dict(predivide=True), TypeError, ["predivide"]),
    ("predivide_str", dict(predivide="2"), TypeError, ["predivide"]),
    ("predivide_nan", dict(predivide=float("nan")), ValueError, ["predivide"]),
    ("predivide_inf", dict(predivide=float("inf")), ValueError, ["predivide"]),
    ("check_finite_yes", dict(check_finite="yes"), ValueError, ["check_finite", "'yes'"]),
    ("check_finite_1", dict(check_finite=1), ValueError, ["check_finite"]),
    ("check_finite_none", dict(check_finite=None), ValueError, ["check_finite"]),
    ("staging_gpu", dict(staging="gpu"), ValueError, ["staging", "'gpu'"]),
    ("timeout_0", dict(timeout=0), ValueError, ["timeout", "0"]),
    ("timeout_str", dict(timeout="60"), TypeError, ["timeout", "str"]),
    ("timeout_bool", dict(timeout=True), TypeError, ["timeout", "bool"]),
    ("on_timeout_kill", dict(timeout=5.0, on_timeout="kill"), ValueError, ["on_timeout", "'kill'"]),
    ("on_timeout_true", dict(timeout=5.0, on_timeout=True), TypeError, ["on_timeout", "bool"]),
    ("on_timeout_no_timeout", dict(on_timeout="abort"), ValueError, ["on_timeout", "timeout=None"]),
    ("unknown_option", dict(bucket_size=4), TypeError, ["bucket_size"]),
]


@pytest.mark.parametrize("case", BAD_ARGS, ids=[c[0] for c in BAD_ARGS])
def test_bad_arguments_fail_at_factory_time(case):
    _, kwargs, exc, words = case
    kwargs = {"axis_name": "i", "comm": None, **kwargs}
    with pytest.raises(exc) as info:
        jaxsync.flat_mean(**kwargs)
    for w in words:
        assert w in str(info.value), f"{w!r} missing from: {info.value}"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_factory_validates_options(strategy):
    with pytest.raises(ValueError, match="reduce"):
        make_tx(strategy, reduce="max")
    with pytest.raises(ValueError, match="bucket_bytes"):
        make_tx(strategy, bucket_bytes=0)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sync_gradients_validates_comm_for_every_strategy(strategy):
    try:
        jaxsync.sync_gradients({"w": jnp.ones(2)}, axis_name=None, strategy=strategy, comm="x")
    except TypeError as e:
        assert "comm" in str(e)
        return
    pytest.fail(
        f"BUG: sync_gradients(strategy={strategy!r}, comm='x') silently accepts an "
        "invalid comm (make_config skips _make_backend for single_node)"
    )


def test_sync_gradients_rejects_unknown_strategy():
    with pytest.raises(ValueError, match="strategy.*'ring'|'ring'.*strategy"):
        jaxsync.sync_gradients({"w": jnp.ones(2)}, axis_name="i", strategy="ring", comm=None)


def test_single_node_mean_has_no_comm_argument():
    with pytest.raises(TypeError, match="comm"):
        jaxsync.single_node_mean(axis_name="i", comm=None)


def test_axis_comm_rejects_non_string():
    with pytest.raises(TypeError, match="axis_name"):
        jaxsync.AxisComm(1)


# Row 7 asks for "TypeError/ValueError naming argument, expected, given, fix".
FIX_CASES = [c for c in BAD_ARGS if c[0] not in ("unknown_option",)]


@pytest.mark.parametrize("case", FIX_CASES, ids=[c[0] for c in FIX_CASES])
def test_bad_argument_message_says_how_to_fix(case):
    _, kwargs, exc, _ = case
    with pytest.raises(exc) as info:
        jaxsync.flat_mean(**{"axis_name": "i", "comm": None, **kwargs})
    assert "Fix" in str(info.value) or "Make sure" in str(info.value), (
        f"row 7 (tests/_common.py): the error for {kwargs} gives no fix: {info.value}"
    )


def test_integer_axis_name_is_rejected_or_works():
    """An int axis name passes validation today, but JAX collectives read ints
    as positional axes, so it fails later with an unrelated error."""
    try:
        tx = jaxsync.flat_mean(axis_name=0, comm=None)
    except TypeError as e:
        assert "axis_name" in str(e)
        return
    try:
        out = jax.vmap(lambda g: apply(tx, g), axis_name=0)(jnp.arange(4.0))
    except Exception as e:  # noqa: BLE001
        pytest.fail(
            "BUG: flat_mean(axis_name=0) is accepted at factory time (the TypeError text "
            "says 'expected: a str, a tuple of str, or None') but cannot work: "
            f"vmap(axis_name=0) then fails with {type(e).__name__}: {e}"
        )
    assert np.array_equal(np.asarray(out), np.full(4, 1.5, np.float32))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("axis_name", [None, ()], ids=["None", "empty_tuple"])
def test_no_axis_means_a_single_replica(strategy, axis_name):
    """axis_name=None (or ()): no mapped axis, one process -> the identity, under plain jit."""
    rng = np.random.default_rng(4)
    tree = {
        "w": jnp.asarray(rng.standard_normal((3, 2)), jnp.float32),
        "h": jnp.asarray(rng.standard_normal(5), jnp.bfloat16),
    }
    opts = {} if strategy == "single_node" else {"comm": None}
    tx = FACTORIES[strategy](axis_name=axis_name, **opts)
    out = jax.jit(lambda g: apply(tx, g))(tree)
    for k in tree:
        assert out[k].dtype == tree[k].dtype
        assert np.array_equal(bits(out[k]), bits(tree[k])), k


# ----------------------------------------------------------------------------
# row 6: unbound axes
# ----------------------------------------------------------------------------


def test_unbound_axis_under_vmap_lists_bound_axes():
    tx = jaxsync.flat_mean(axis_name="i", comm=None)
    with pytest.raises(NameError, match=r"'i'.*bound axes.*'j'"):
        jax.vmap(lambda g: apply(tx, g), axis_name="j")(jnp.ones((4, 2)))


def test_unbound_axis_in_tuple_names_the_missing_one():
    tx = jaxsync.hierarchical_mean(axis_name=("i", "x"), comm=None)
    with pytest.raises(NameError, match=r"'x'.*bound axes.*'i'"):
        jax.vmap(lambda g: apply(tx, g), axis_name="i")(jnp.ones((4, 2)))


def test_unbound_axis_under_shard_map_lists_mesh_axes():
    tx = jaxsync.two_dimensional_mean(axis_name="data", comm=None)
    with pytest.raises(NameError, match=r"'data'.*bound axes.*'i'"):
        on_mesh(lambda g: apply(tx, g))(jnp.ones((N, 2)))


def test_unbound_comm_axis_is_named():
    tx = jaxsync.hierarchical_mean(axis_name="i", comm=jaxsync.AxisComm("host"))
    with pytest.raises(NameError, match=r"comm axis 'host'.*bound axes.*'i'"):
        on_mesh(lambda g: apply(tx, g))(jnp.ones((N, 2)))


@pytest.mark.parametrize("how", ["eager", "jit", "eval_shape"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_outside_any_mapped_context(strategy, how):
    tx = make_tx(strategy)
    f = lambda g: apply(tx, g)
    g = {"w": jnp.ones(3)}
    call = {"eager": f, "jit": jax.jit(f), "eval_shape": lambda t: jax.eval_shape(f, t)}[how]
    with pytest.raises(NameError, match=r"'i' is not bound.*none \(not inside"):
        call(g)


def test_sync_gradients_unbound_axis():
    with pytest.raises(NameError, match="bound axes"):
        jaxsync.sync_gradients({"w": jnp.ones(2)}, axis_name="i", strategy="flat", comm=None)


# ----------------------------------------------------------------------------
# broadcast_params in one process
# ----------------------------------------------------------------------------


def test_broadcast_params_single_process_is_identity():
    tree = {"w": jnp.arange(3.0), "n": jnp.int32(2), "h": jnp.ones(2, jnp.bfloat16)}
    out = jaxsync.broadcast_params(tree, comm=None)
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    for k in tree:
        assert out[k].dtype == tree[k].dtype
        assert np.array_equal(bits(out[k]), bits(tree[k]))


@pytest.mark.parametrize(
    "root,comm,exc,word",
    [
        (1, None, ValueError, "root"),
        (True, None, TypeError, "root"),
        (1.0, None, TypeError, "root"),
        (1, jaxsync.AxisComm("host"), ValueError, "root"),
    ],
)
def test_broadcast_params_bad_root(root, comm, exc, word):
    with pytest.raises(exc, match=word):
        jaxsync.broadcast_params({"w": jnp.ones(2)}, root=root, comm=comm)


# ----------------------------------------------------------------------------
# row 8: wrong state
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "check_finite,state",
    [
        (True, optax.EmptyState()),
        (True, (jnp.array(True),)),
        (True, None),
        (False, jaxsync.SyncState(jnp.array(True))),
        (False, ()),
        (False, None),
        (False, optax.ScaleByAdamState(jnp.zeros([], jnp.int32), {}, {})),
    ],
    ids=[
        "empty_for_check",
        "tuple_for_check",
        "none_for_check",
        "syncstate_for_plain",
        "tuple_for_plain",
        "none_for_plain",
        "adam_state",
    ],
)
@pytest.mark.parametrize("strategy", ["flat", "single_node"])
def test_update_with_wrong_state(strategy, check_finite, state):
    tx = make_tx(strategy, check_finite=check_finite)
    with pytest.raises(TypeError, match="init") as info:
        tx.update({"w": jnp.ones(2)}, state)
    assert type(state).__name__ in str(info.value)


# ----------------------------------------------------------------------------
# row 5: float0 leaves through a sync
# ----------------------------------------------------------------------------


def test_float0_gradients_pass_through_sync():
    def step(p):
        g = jax.grad(lambda p: jnp.sum(p["w"] * p["n"].astype(jnp.float32)), allow_int=True)(p)
        return jaxsync.sync_gradients(g, axis_name="i", strategy="flat", comm=None)

    params = {"w": jnp.ones((N, 3)), "n": jnp.tile(jnp.arange(3, dtype=jnp.int32), (N, 1))}
    try:
        out = jax.vmap(step, axis_name="i")(params)
    except TypeError as e:
        pytest.fail(
            "BUG: sync of a jax.grad(allow_int=True) tree fails on its float0 leaf "
            f"(documented to pass through): {e}"
        )
    assert out["n"].dtype == jax.dtypes.float0
    assert np.array_equal(np.asarray(out["w"]), np.tile(np.arange(3, dtype=np.float32), (N, 1)))


# ----------------------------------------------------------------------------
# row 18: eager == jit
# ----------------------------------------------------------------------------

# Eager shard_map dispatches every primitive separately (seconds per strategy on
# 2 cores): run it for two_dimensional, which uses every collective (psum_scatter,
# all_to_all and all_gather for 16-bit data, all_gather).
EAGER_CASES = [(s, "vmap") for s in STRATEGIES] + [("two_dimensional", "shard_map")]


@pytest.mark.parametrize("strategy,layout", EAGER_CASES)
def test_eager_and_jit_agree(strategy, layout):
    rng = np.random.default_rng(9)
    tree = {
        "w": jnp.asarray(rng.standard_normal((N, 3, 2)), jnp.float32),
        "h": jnp.asarray(rng.standard_normal((N, 5)), jnp.bfloat16),
        "i": jnp.arange(N, dtype=jnp.int32),
    }
    tx = make_tx(strategy)
    f = lambda g: apply(tx, g)
    if layout == "vmap":
        eager, jitted = jax.vmap(f, axis_name="i"), jax.jit(jax.vmap(f, axis_name="i"))
    else:
        eager, jitted = on_mesh(f, jit=False), on_mesh(f, jit=True)
    a, b = eager(tree), jitted(tree)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for k in tree:
        assert jax.typeof(a[k]) == jax.typeof(b[k]), (k, jax.typeof(a[k]), jax.typeof(b[k]))
        assert a[k].dtype == tree[k].dtype
        assert np.array_equal(bits(a[k]), bits(b[k])), k


# ----------------------------------------------------------------------------
# training parity with single-device optax
# ----------------------------------------------------------------------------


def _regression_problem():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((64, 4))
    Y = np.tanh(X @ rng.standard_normal((4, 2))) + 0.1 * rng.standard_normal((64, 2))
    params = {
        "w1": rng.standard_normal((4, 8)) * 0.5,
        "b1": np.zeros(8),
        "w2": rng.standard_normal((8, 2)) * 0.5,
        "b2": np.zeros(2),
    }
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    return jax.tree.map(f32, params), f32(X), f32(Y)


def _loss(p, x, y):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)


OPTIMIZERS = {"adam": lambda: optax.adam(1e-2), "sgd": lambda: optax.sgd(0.1)}


def _train_single(params, X, Y, steps, opt_name):
    opt = OPTIMIZERS[opt_name]()

    @jax.jit
    def step(p, s):
        u, s = opt.update(jax.grad(_loss)(p, X, Y), s, p)
        return optax.apply_updates(p, u), s

    state = opt.init(params)
    for _ in range(steps):
        params, state = step(params, state)
    return params


def _train_synced(params, X, Y, steps, layout, opt_name, replicated_grads=False):
    if layout == "flat":
        sync = jaxsync.flat_mean(axis_name="i", comm=None)
        mesh, axes, data = MESH1, ("i",), P("i")
    else:
        sync = jaxsync.hierarchical_mean(axis_name="local", comm=jaxsync.AxisComm("host"))
        mesh, axes, data = MESH2, HL, P(HL)
    opt = optax.chain(sync, OPTIMIZERS[opt_name]())

    def local_step(p, s, x, y):
        # Parameters are replicated (P()). Either differentiate a per-device copy
        # marked as varying, so the gradient is the local one and jaxsync does all
        # the averaging, or differentiate the replicated value directly: then
        # shard_map's autodiff has already summed the gradients over the mesh axes
        # and jaxsync must count them once, not sum them again.
        q = p if replicated_grads else lax.pcast(p, axes, to="varying")
        g = jax.grad(_loss)(q, x, y)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(
        jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(), data, data), out_specs=(P(), P()))
    )
    put = lambda tree, spec: jax.device_put(tree, NamedSharding(mesh, spec))
    params, X, Y = put(params, P()), put(X, data), put(Y, data)
    state = put(opt.init(params), P())
    for _ in range(steps):
        params, state = step(params, state, X, Y)
    assert step._cache_size() == 1, "the training step recompiled"
    return params


@pytest.mark.parametrize("replicated_grads", [False, True], ids=["varying", "replicated"])
@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
@pytest.mark.parametrize("layout", ["flat", "hierarchical_axiscomm"])
def test_training_matches_single_device(layout, opt_name, replicated_grads):
    """optax.chain(jaxsync.<strategy>, opt) on 8 devices, batch split 8 ways, matches
    opt on one device with the whole batch. Adam is (nearly) invariant to the
    gradient's scale, so it alone would not catch a wrong divisor: SGD does."""
    params, X, Y = _regression_problem()
    steps = 25
    # optax.adam's bias correction computes `float ** int32`, which strict dtype
    # promotion (conftest) rejects; that is optax's business, not jaxsync's.
    with jax.numpy_dtype_promotion("standard"):
        want = _train_single(params, X, Y, steps, opt_name)
        got = _train_synced(params, X, Y, steps, layout, opt_name, replicated_grads)
    moved = max(float(jnp.max(jnp.abs(want[k] - params[k]))) for k in params)
    assert moved > 0.05, "training did not move the parameters; the test would be vacuous"
    for k in params:
        # The gradient is the same mean in a different summation order (a few ULP);
        # over 25 steps that stays well inside rtol 1e-5 / atol 1e-6.
        np.testing.assert_allclose(
            np.asarray(got[k]),
            np.asarray(want[k]),
            rtol=1e-5,
            atol=1e-6,
            err_msg=f"{layout}/{opt_name}: parameter {k} diverged",
        )


@pytest.mark.parametrize("factory", ["auto_mean", "sign_mean", "powersgd_mean"])
def test_on_timeout_is_taken_and_checked_by_every_factory(factory):
    """Every factory that takes ``timeout`` takes ``on_timeout`` too (issue 27)."""
    make = getattr(jaxsync, factory)
    make(axis_name="i", comm=None, timeout=5.0, on_timeout="abort")
    with pytest.raises(ValueError, match="on_timeout"):
        make(axis_name="i", comm=None, timeout=5.0, on_timeout="kill")
    with pytest.raises(ValueError, match="on_timeout"):
        make(axis_name="i", comm=None, on_timeout="abort")

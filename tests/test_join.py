"""Uneven inputs in one process (8 fake devices): ``weights=`` and the join.

Every replica has a weight (an integer) and dyadic gradients, so the weighted
mean ``sum(w g) / sum(w)`` is exact in float32 and compared bitwise with its
closed form; the join loop (replicas with different batch counts) ends at the
same step everywhere with the parameters of a closed-form SGD run.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _common import MESH1, STRATEGIES, N, bits
from jax.sharding import PartitionSpec as P

import jaxsync

W = np.array([1, 2, 0, 3, 4, 0, 1, 5], np.float32)  # replicas 2 and 5: weight 0


def _grads():
    a = np.arange(N * 6, dtype=np.float32).reshape(N, 2, 3) / 4
    a[2, 0, 0] = np.nan  # on a replica of weight 0: it adds nothing
    b = (np.arange(N, dtype=np.float32) - 3)[:, None] / 2 * np.ones((N, 2), np.float32)
    return {"a": a, "b": b.astype(jnp.bfloat16), "i": np.arange(N, dtype=np.int32)}


def _want(g, w, world=False):
    out = {}
    for k in ("a", "b"):
        x = np.where((w != 0).reshape((N,) + (1,) * (g[k].ndim - 1)), g[k], 0).astype(np.float32)
        s = (x * w.reshape((N,) + (1,) * (x.ndim - 1))).sum(0)
        out[k] = (s / (N if world else w.sum())).astype(g[k].dtype)
    return out


def _tx(name, **kw):
    comm = {} if name == "single_node" else {"comm": None}
    return getattr(jaxsync, f"{name}_mean")(axis_name="i", **comm, **kw)


def _mapped(mapper, tx, g, w, done):
    def f(g, w, d):
        u, s = tx.update(g, tx.init(g), weight=w, done=d)
        return u, s.active, s.weight

    if mapper == "vmap":
        return jax.vmap(f, axis_name="i")(g, w, done)
    if mapper == "pmap":
        return jax.pmap(f, axis_name="i")(g, w, done)
    one = lambda g, w, d: f(*jax.tree.map(lambda x: x[0], (g, w, d)))
    sm = jax.shard_map(
        lambda g, w, d: jax.tree.map(lambda x: x[None], one(g, w, d)),
        mesh=MESH1,
        in_specs=P("i"),
        out_specs=P("i"),
    )
    return jax.jit(sm)(g, w, done)


CASES = [(s, "vmap") for s in STRATEGIES] + [("hierarchical", m) for m in ("pmap", "shard_map")]


@pytest.mark.parametrize("name, mapper", CASES)
def test_weighted_mean_is_the_closed_form(name, mapper):
    g, done = _grads(), W == 0
    for weights in (True, "world"):
        out, active, total = _mapped(mapper, _tx(name, weights=weights), g, W, done)
        want = _want(g, W, world=weights == "world")
        for r in range(N):
            for k in ("a", "b"):
                np.testing.assert_array_equal(bits(out[k][r]), bits(want[k]), err_msg=k)
            np.testing.assert_array_equal(out["i"][r], g["i"][r])  # ints pass through
        assert active.tolist() == [6] * N and total.tolist() == [16.0] * N


def test_every_weight_zero_gives_zeros_and_all_done():
    g = _grads()
    out, active, total = _mapped("vmap", _tx("flat", weights=True), g, 0 * W, W == W)
    assert not np.asarray(out["a"]).any() and not np.asarray(out["b"], np.float32).any()
    assert active.tolist() == [0] * N and total.tolist() == [0.0] * N


def _loop(tx, batches, mapper="shard_map"):
    """Replica r has ``batches[r]`` batches (gradient ``(t + 1) * (r + 1) / 4``,
    weight ``r + 1``); every replica calls the same step until ``all_done``."""
    params = {"w": jnp.zeros((3,), jnp.float32), "s": jnp.zeros((), jnp.float32)}
    specs = jaxsync.state_specs(jax.eval_shape(tx.init, params), "i")

    def step(p, state, g, w, done):
        u, state = tx.update(jax.tree.map(lambda x, q: x.reshape(q.shape), g, p), state, p,
                             weight=w[0], done=done[0])  # fmt: skip
        return optax.apply_updates(p, u), state, jaxsync.all_done(state)

    init = jax.jit(jax.shard_map(tx.init, mesh=MESH1, in_specs=P(), out_specs=specs))
    run = jax.jit(
        jax.shard_map(
            step, mesh=MESH1, in_specs=(P(), specs, P("i"), P("i"), P("i")),
            out_specs=(P(), specs, P()),
        )
    )  # fmt: skip
    state, p, t = init(params), params, 0
    r = np.arange(N, dtype=np.float32)
    while True:
        have = t < batches
        val = np.where(have, (t + 1) * (r + 1) / 4, 0).astype(np.float32)
        g = {"w": np.repeat(val[:, None], 3, 1), "s": val}
        w = np.where(have, r + 1, 0).astype(np.float32)
        p, state, stop = run(p, state, g, w, t + 1 >= batches)
        t += 1
        if stop:
            return p, t


def _closed_form(batches, lr=0.5):
    w = np.zeros((3,), np.float32)
    r = np.arange(N, dtype=np.float32)
    for t in range(batches.max()):
        have = t < batches
        num = np.sum(np.where(have, (t + 1) * (r + 1) / 4 * (r + 1), 0), dtype=np.float32)
        w = w - np.float32(lr) * (num / np.sum(np.where(have, r + 1, 0), dtype=np.float32))
    return w


BATCHES = np.array([3, 1, 2, 3, 1, 2, 2, 1])


def test_join_loop_ends_together_with_the_closed_form():
    want = _closed_form(BATCHES)
    txs = {
        "chain": optax.chain(_tx("hierarchical", weights=True), optax.sgd(0.5)),
        "sharded": jaxsync.sharded(optax.sgd(0.5), axis_name="i", comm=None, weights=True),
    }
    for what, tx in txs.items():
        p, steps = _loop(tx, BATCHES)
        assert steps == BATCHES.max(), what  # no step after the last batch
        np.testing.assert_array_equal(bits(p["w"]), bits(want), err_msg=what)
        np.testing.assert_array_equal(bits(p["s"]), bits(want[0]), err_msg=what)
    with pytest.warns(UserWarning, match="double_buffering"):
        tx = _tx("flat", weights=True, double_buffering=True)
    p, steps = _loop(optax.chain(tx, optax.sgd(0.5)), BATCHES)
    assert steps == BATCHES.max() + 1  # learns of the last step one step later
    np.testing.assert_array_equal(bits(p["w"]), bits(want))  # every batch applied


def test_weights_errors():
    with pytest.raises(ValueError, match="weights must be one of"):
        _tx("flat", weights="sum")
    with pytest.raises(ValueError, match="reduce='mean'"):
        _tx("flat", weights="world", reduce="sum")
    tx = _tx("flat", weights=True)
    g = {"a": jnp.ones((N, 2))}
    with pytest.raises(ValueError, match="weight= must be a real scalar"):
        jax.vmap(lambda g: tx.update(g, tx.init(g), weight=jnp.ones(2)), axis_name="i")(g)
    with pytest.raises(TypeError, match="expected WeightedState"):
        jax.vmap(lambda g: tx.update(g, optax.EmptyState()), axis_name="i")(g)
    with pytest.raises(ValueError, match="found 0"):
        jaxsync.all_done(optax.EmptyState())
    # reduce="sum" with weights: the weighted sum
    out = jax.vmap(
        lambda g, w: _tx("flat", weights=True, reduce="sum").update(g, tx.init(g), weight=w)[0],
        axis_name="i",
    )(g, jnp.asarray(W))
    assert out["a"][0].tolist() == [16.0, 16.0]


def _collectives(jaxpr) -> int:
    from jax._src import core

    n = 0
    for e in jaxpr.eqns:
        n += e.primitive.name in ("psum", "psum_invariant", "all_gather", "reduce_scatter")
        for sub in core.jaxprs_in_params(e.params):
            n += _collectives(sub)
    return n


@pytest.mark.parametrize("name", ["flat", "hierarchical"])
def test_weights_add_no_collective(name):
    """The weights ride in the gradients' packed buffer: as many collectives."""
    g = {"a": jnp.ones((N, 5)), "b": jnp.ones((N, 3))}
    counts = []
    for kw, extra in (({}, {}), ({"weights": True}, {"weight": 2.0, "done": False})):
        tx = _tx(name, **kw)
        f = jax.vmap(lambda g: tx.update(g, tx.init(g), **extra)[0], axis_name="i")
        counts.append(_collectives(jax.make_jaxpr(f)(g).jaxpr))
    assert counts[0] == counts[1] >= 1, counts


def test_auto_mean_takes_weights_like_the_strategy_it_picks():
    """``auto_mean(weights=...)``: the closed form, the same in a chain (optax
    passes ``weight=``/``done=`` to an ExtraArgs transform), and ``describe``."""
    g, done = _grads(), W == 0
    for weights in (True, "world"):
        tx = jaxsync.auto_mean("i", comm=None, weights=weights)
        assert isinstance(tx, optax.GradientTransformationExtraArgs)
        out, active, total = _mapped("vmap", tx, g, W, done)
        want = _want(g, W, world=weights == "world")
        for k in ("a", "b"):
            np.testing.assert_array_equal(bits(out[k][0]), bits(want[k]), err_msg=k)
        assert active.tolist() == [6] * N and total.tolist() == [16.0] * N
    assert "predicted" in tx.describe()
    chain = optax.chain(jaxsync.auto_mean("i", comm=None, weights=True), optax.sgd(1.0))
    f = lambda g, w: chain.update(g, chain.init(g), weight=w)[0]
    u = jax.vmap(f, axis_name="i")({"a": g["a"]}, jnp.asarray(W))
    np.testing.assert_array_equal(bits(u["a"][0]), bits(-_want(g, W)["a"]))


def test_compressors_take_weights_prescaled():
    """``powersgd_mean`` / ``sign_mean`` with ``weights=``: the weights are summed
    first and each replica's gradients scaled by ``w N / W`` (here ``w / 2``,
    exact). Sign compression is exact for gradients of one magnitude per replica
    (their scale is that magnitude): the closed form, bitwise. PowerSGD at full
    rank reproduces the mean to float32 rounding. A replica of weight 0 adds
    nothing (its NaN included); a step of all-zero weights gives zeros and keeps
    the residuals."""
    rng = np.random.default_rng(0)
    signs = np.where(rng.random((N, 16, 32)) < 0.5, -1.0, 1.0).astype(np.float32)
    g = {"w": signs * (1 + np.arange(N, dtype=np.float32))[:, None, None] / 4}
    g["w"][2, 0, 0] = np.nan  # weight 0
    want = _want({"a": g["w"], "b": g["w"][:, :1]}, W)["a"]
    sign = jaxsync.sign_mean("i", comm=None, weights=True)
    psgd = jaxsync.powersgd_mean("i", comm=None, weights=True, rank=16, min_compression_rate=0.0)
    for tx in (sign, psgd):
        assert isinstance(tx, optax.GradientTransformationExtraArgs)
        state = jax.vmap(tx.init)(g)
        run = jax.vmap(lambda g, s, w, d: tx.update(g, s, weight=w, done=d), axis_name="i")
        out, state = run(g, state, jnp.asarray(W), jnp.asarray(W == 0))
        assert state.active.tolist() == [6] * N and state.weight.tolist() == [16.0] * N
        if tx is sign:
            np.testing.assert_array_equal(bits(out["w"][0]), bits(want))
        else:
            np.testing.assert_allclose(out["w"][0], want, rtol=2e-5, atol=2e-5)
        before = jax.tree.leaves(state.inner)
        out0, state0 = run(g, state, 0 * jnp.asarray(W), jnp.asarray(W == W))
        assert not np.any(np.asarray(out0["w"])) and state0.active.tolist() == [0] * N
        for a, b in zip(before, jax.tree.leaves(state0.inner)):
            np.testing.assert_array_equal(bits(a), bits(b))


@pytest.mark.parametrize(
    "comm_dtype", [jnp.bfloat16, jaxsync.Quantized(bits=8), jaxsync.Quantized(bits=4)]
)
def test_a_lossy_wire_keeps_the_weights_and_counts_exact(comm_dtype):
    """With a lossy wire the weights and counts travel in float32 beside it: 4
    bits rounded a count of 1 beside a weight of 300 to 0 (``all_done`` while a
    replica still trains) and bfloat16 the weights' sum 1221 to 1216."""
    w = jnp.asarray([[300.0, 301.0], [0.0, 620.0]])
    done = jnp.asarray([[True, True], [True, False]])
    g = {"a": jnp.ones((2, 2, 64), jnp.float32) * jnp.arange(1.0, 5.0).reshape(2, 2, 1) / 4}
    tx = jaxsync.flat_mean(
        "local", comm=jaxsync.AxisComm("host"), weights=True, comm_dtype=comm_dtype
    )

    def f(g, w, d):
        out, s = tx.update(g, tx.init(g), weight=w, done=d)
        return out, s.active, s.weight

    out, active, total = jax.vmap(jax.vmap(f, axis_name="local"), axis_name="host")(g, w, done)
    assert active.tolist() == [[1, 1], [1, 1]] and total.tolist() == [[1221.0] * 2] * 2
    want = (300 * 0.25 + 301 * 0.5 + 620 * 1.0) / 1221
    np.testing.assert_allclose(out["a"], want, rtol=2**-6)


# One NaN weight; weights 1 and -1 (sum 0, members not 0); a negative sum: each
# gives sum(w g) / sum(w) as IEEE has it (NaN, +-inf, the exact quotient), not
# the zeros that only a step of all-zero weights gives.
BAD_WEIGHTS = {
    "nan": np.array([1, np.nan, 0, 3, 4, 0, 1, 5], np.float32),
    "sum_zero": np.array([1, -1, 0, 0, 0, 0, 0, 0], np.float32),
    "negative": np.array([1, -2, 0, 0, 0, 0, 0, 0], np.float32),
}


@pytest.mark.parametrize("case", list(BAD_WEIGHTS))
@pytest.mark.parametrize("name", STRATEGIES + ["flat_bf16", "sign"])
def test_bad_weights_give_the_quotient_not_zeros(name, case):
    w = BAD_WEIGHTS[case]
    g = _grads()
    if name == "sign":  # one magnitude per replica: sign compression exact
        g["a"] = np.ones_like(g["a"]) * (1 + np.arange(N, dtype=np.float32))[:, None, None] / 4
        tx = jaxsync.sign_mean("i", comm=None, weights=True, min_size=1)
    elif name == "flat_bf16":  # the counts' float32 sync beside a lossy wire
        tx = _tx("flat", weights=True, comm_dtype=jnp.bfloat16)
    else:
        tx = _tx(name, weights=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        want = _want(g, w)
    out, _, total = _mapped("vmap", tx, g, w, w == 0)
    np.testing.assert_array_equal(total, np.full(N, w.sum(), np.float32))
    keys = ("a",) if name == "sign" else ("a", "b")
    for k in keys:
        got = np.asarray(out[k][0], np.float32)
        if case == "negative":
            if name in ("flat_bf16", "sign"):  # a 16-bit wire / a prescaled sign
                np.testing.assert_allclose(got, np.asarray(want[k], np.float32), rtol=2**-7)
            else:
                np.testing.assert_array_equal(bits(out[k][0]), bits(want[k]), err_msg=k)
        else:  # not finite anywhere, so check_finite sees it
            assert not np.isfinite(got).any(), (k, got)


@pytest.mark.parametrize("name", ["flat", "hierarchical_bf16", "sharded", "double_buffering"])
def test_early_termination_raise_stops_every_replica(name):
    """``early_termination="raise"`` (Horovod's ``throw_on_early_termination``):
    a step where some but not all replicas pass ``done=True`` raises, naming how
    many (with double buffering: the step after, with the delayed count); one
    where none or all are done runs as the join does."""
    if name == "double_buffering":
        with pytest.warns(UserWarning):  # one process: nothing to overlap
            tx = _tx("flat", weights=True, double_buffering=True, early_termination="raise")
    elif name == "sharded":
        tx = jaxsync.sharded(optax.sgd(1.0), axis_name="i", comm=None, weights=True,
                             early_termination="raise")  # fmt: skip
    elif name == "hierarchical_bf16":  # the counts' own float32 sync
        tx = _tx("hierarchical", weights=True, comm_dtype=jnp.bfloat16, early_termination="raise")
    else:
        tx = _tx(name, weights=True, early_termination="raise")
    g = {"w": jnp.ones((N, 4), jnp.float32)}
    params = {"w": jnp.zeros((4,), jnp.float32)}
    state = jax.vmap(lambda _: tx.init(params), axis_name="i")(jnp.arange(N))

    @jax.jit
    def step(g, state, done):
        f = lambda g, s, d: tx.update(g, s, params, weight=1.0, done=d)
        return jax.vmap(f, axis_name="i", in_axes=(0, 0, 0))(g, state, done)

    for done in (np.zeros(N, bool), np.ones(N, bool)):  # none / all done: no error
        out, s = jax.block_until_ready(step(g, state, done))
        delayed = name == "double_buffering"  # the count of init's pending step
        assert s.active.tolist() == [N if delayed or not done[0] else 0] * N
    done = mixed = np.zeros(N, bool)
    done[[1, 6]] = True
    if name == "double_buffering":  # this step applies the last one's mean: no error yet
        _, state = jax.block_until_ready(step(g, state, done))
        done = np.ones(N, bool)
    with pytest.raises(RuntimeError, match=r"early termination: 2 of 8 replicas passed done=True"):
        jax.block_until_ready(step(g, state, done))
    jax.effects_barrier()
    # the default joins: the same step runs, with the count of replicas left
    join = _tx("flat", weights=True)
    s = jax.vmap(lambda g, d: join.update(g, join.init(g), weight=1.0, done=d)[1],
                 axis_name="i")(g, mixed)  # fmt: skip
    assert s.active.tolist() == [6] * N


def test_early_termination_is_validated_in_the_factory():
    with pytest.raises(ValueError, match=r"early_termination must be 'join' or 'raise', got True"):
        _tx("flat", weights=True, early_termination=True)
    with pytest.raises(ValueError, match=r"early_termination='raise' .* weights=False\. Fix"):
        _tx("naive", early_termination="raise")
    with pytest.raises(ValueError, match=r"sharded: early_termination must be"):
        jaxsync.sharded(optax.sgd(1.0), axis_name="i", comm=None, weights=True,
                        early_termination="throw")  # fmt: skip


def test_early_termination_is_in_the_agreed_text():
    """Ranks made with another ``early_termination`` are told that it differs
    (one would raise while the other waits in its next sync); the default's
    text is as it was."""
    import dataclasses

    from jaxsync._comm._agree import _option_difference
    from jaxsync._core._config import make_config

    cfg = make_config("flat_mean", "flat", "i", None)
    text = {
        e: dataclasses.replace(cfg, weights=(True, "mean", None, e)).describe()
        for e in ("join", "raise")
    }
    assert "early_termination" not in text["join"] and text["join"].endswith("weights True")
    assert _option_difference(text["join"], text["raise"]) == [
        ("early_termination <unset>", "early_termination raise")
    ]

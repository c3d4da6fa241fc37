"""powersgd_mean and sign_mean (compressed sync with error feedback), one process.

Replicas are rows of a ``vmap(axis_name="i")`` (comm=None), or devices of a
(host=2, local=4) mesh with ``AxisComm("host")`` as the inter-process stage.
The multi-process tests (mpirun -n 2 x 2 devices: bit-identical replicas after
50 steps, checkpoint round trip) are in tests/mpi/test_compress_mpi.py.
"""

from __future__ import annotations

import io
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _common import MESH2, bits
from jax.sharding import PartitionSpec as P

import jaxsync
from jaxsync.bench import digits
from jaxsync.compress import _common as _compress
from jaxsync.compress import _sign

R = 4  # replicas


def vmapped(tx):
    """(init, update) over R replicas stacked on a leading axis."""
    return jax.vmap(tx.init), jax.jit(jax.vmap(tx.update, axis_name="i"))


# --------------------------------------------------------------------------
# Factory validation (row 7)


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(rank=0), ValueError, "rank must be >= 1"),
        (dict(rank=2.0), TypeError, "'rank'"),
        (dict(start_step=-1), ValueError, "start_step must be >= 0"),
        (dict(min_compression_rate=-1.0), ValueError, "min_compression_rate"),
        (dict(min_compression_rate="2"), TypeError, "'min_compression_rate'"),
        (dict(error_feedback=1), TypeError, "'error_feedback'"),
        (dict(warm_start=None), TypeError, "'warm_start'"),
        (dict(seed=-3), ValueError, "seed must be >= 0"),
        (dict(staging="gpu"), ValueError, "staging"),
    ],
)
def test_powersgd_rejects_bad_options(kwargs, exc, words):
    with pytest.raises(exc, match="powersgd_mean") as e:
        jaxsync.powersgd_mean(axis_name="i", comm=None, **kwargs)
    assert words in str(e.value) and "Fix" in str(e.value)


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(min_size=0), ValueError, "min_size must be >= 1"),
        (dict(min_size=True), TypeError, "'min_size'"),
        (dict(error_feedback="yes"), TypeError, "'error_feedback'"),
        (dict(timeout=-1.0), ValueError, "timeout"),
    ],
)
def test_sign_rejects_bad_options(kwargs, exc, words):
    with pytest.raises(exc, match="sign_mean") as e:
        jaxsync.sign_mean(axis_name="i", comm=None, **kwargs)
    assert words in str(e.value) and "Fix" in str(e.value)


def test_wrong_state_raises():
    tx = jaxsync.powersgd_mean(axis_name=None, comm=None)
    with pytest.raises(TypeError, match="PowerSGDState"):
        tx.update({"w": jnp.ones((8, 8))}, optax.EmptyState())
    tx = jaxsync.sign_mean(axis_name=None, comm=None, min_size=1)
    state = tx.init({"w": jnp.ones(4)})
    with pytest.raises(ValueError, match="compressed leaves"):
        tx.update({"w": jnp.ones(4), "v": jnp.ones(4)}, state)


# --------------------------------------------------------------------------
# Which leaves are compressed


def test_powersgd_layout_rule():
    leaves = [
        jnp.zeros((64, 64)),
        jnp.zeros((3, 3, 32, 64)),
        jnp.zeros((64,)),
        jnp.zeros((8, 4)),
        jnp.zeros((16, 16), jnp.int32),
        jnp.zeros((0, 5)),
    ]
    got = _compress._powersgd_layout(leaves, rank=4, min_rate=2.0)
    # 64x64: 4096 / (4 * 128) = 8; conv: last axis against the rest, 288 x 64;
    # 8x4 with r = 4: 32 / 48 < 2 (sent exact); ints, vectors, empty: exact.
    assert got == [(64, 64, 4), (288, 64, 4), None, None, None, None]
    assert _compress._powersgd_layout([jnp.zeros((8, 4))], 4, 0.0) == [(8, 4, 4)]


def test_powersgd_matrix_view_fits_both_layouts():
    """An equinox/PyTorch conv kernel (out, in, kh, kw) is compressed as (out, in kh kw),
    a flax one (h, w, in, out) as (h w in, out): before matrix_view, Conv2d(64, 64, 3)'s
    kernel was seen as (64 * 64 * 3, 3), below min_compression_rate, and sent whole."""
    eqx_conv, flax_conv = jnp.zeros((64, 32, 3, 3)), jnp.zeros((3, 3, 32, 64))
    tx = jaxsync.powersgd_mean(axis_name=None, comm=None)  # the defaults
    state = tx.init({"conv": eqx_conv})
    assert [q.shape for q in state.q] == [(288, 4)]  # Q is (m, r): m = 32 * 3 * 3
    assert [q.shape for q in tx.init({"conv": flax_conv}).q] == [(64, 4)]
    layout = _compress._powersgd_layout
    assert layout([eqx_conv, flax_conv], 4, 2.0, "auto") == [(64, 288, 4), (288, 64, 4)]
    assert layout([eqx_conv], 4, 2.0, "last") == [None]  # (6144, 3): too little saved
    assert layout([eqx_conv], 4, 0.0, "first") == [(64, 288, 4)]
    assert layout([jnp.zeros((8, 8, 8))], 4, 0.0, "auto") == [(64, 8, 4)]  # tie: "last"
    # Per leaf: a callable (path, shape) -> view or None (sent exactly).
    pick = lambda path, shape: None if "skip" in path else "first"
    tx = jaxsync.powersgd_mean(axis_name=None, comm=None, matrix_view=pick)
    state = tx.init({"a": jnp.zeros((16, 256)), "skip": jnp.zeros((256, 16))})
    assert [q.shape for q in state.q] == [(256, 4)]
    with pytest.raises(ValueError, match="matrix_view must be one of.*got 'rows'"):
        jaxsync.powersgd_mean(axis_name=None, comm=None, matrix_view="rows")
    bad = jaxsync.powersgd_mean(axis_name=None, comm=None, matrix_view=lambda p, s: "rows")
    with pytest.raises(
        ValueError, match=r"matrix_view\(\"\['w'\]\", \(16, 256\)\) returned 'rows'"
    ):
        bad.init({"w": jnp.zeros((16, 256))})


def test_powersgd_describe_lists_leaves_and_bytes():
    tx = jaxsync.powersgd_mean(axis_name=None, comm=None, rank=2)
    params = {"k": jnp.zeros((16, 1, 3, 3)), "w": jnp.zeros((64, 400)), "b": jnp.zeros(64)}
    text = tx.describe(params)
    head, *rows = text.splitlines()
    assert head.startswith("powersgd_mean(rank=2, min_compression_rate=2.0, matrix_view='auto')")
    # P and Q in float32: 2 (16 + 9) + 2 (64 + 400) values; the bias whole.
    sent = 4 * (2 * (16 + 9) + 2 * (64 + 400)) + 4 * 64
    assert "2 of 3 leaves compressed" in head and f"{sent:,} bytes per step" in head
    assert rows == [
        "  ['b']  (64,) float32  exact (saves too little, or not a matrix): 256 bytes",
        "  ['k']  (16, 1, 3, 3) float32  as (16, 9)  rank 2  compressed: 200 bytes instead of "
        "576 (2.9x)",
        "  ['w']  (64, 400) float32  as (64, 400)  rank 2  compressed: 3,712 bytes instead of "
        "102,400 (27.6x)",
    ]
    # The method survives as the transform's, and its state is unchanged by it.
    assert isinstance(tx, optax.GradientTransformation)


def test_powersgd_warns_once_when_most_bytes_stay_uncompressed():
    tx = jaxsync.powersgd_mean(axis_name=None, comm=None)
    mostly_dense = {"w": jnp.zeros((64, 64)), "table": jnp.zeros((4096, 3))}
    with pytest.warns(UserWarning, match=r"only 25% of the tree's.*\['table'\] \(4096, 3\)"):
        tx.init(mostly_dense)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tx.init(mostly_dense)  # once per tree
        tx.init({"w": jnp.zeros((64, 64)), "b": jnp.zeros(64)})  # mostly compressed


# --------------------------------------------------------------------------
# PowerSGD: exact when the rank covers the mean's rank (random data, f64 reference)


def low_rank_grads(seed, n=24, m=10, k=3):
    """R replicas whose matrices share a column space of rank k (so the mean has
    rank <= k), plus a bias and an integer leaf sent exact."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n, k))
    b = rng.standard_normal((R, m, k))
    w = np.einsum("nk,rmk->rnm", a, b).astype(np.float32)
    conv = np.einsum(
        "nk,rmk->rnm", rng.standard_normal((3 * 3 * 4, k)), rng.standard_normal((R, 8, k))
    ).reshape(R, 3, 3, 4, 8)
    # equinox's / PyTorch's (out, in, kh, kw) kernel, of rank k as (out, in kh kw)
    oihw = np.einsum(
        "nk,rmk->rnm", rng.standard_normal((8, k)), rng.standard_normal((R, 4 * 3 * 3, k))
    ).reshape(R, 8, 4, 3, 3)
    return {
        "w": w,
        "conv": conv.astype(np.float32),
        "oihw": oihw.astype(np.float32),
        "bias": rng.standard_normal((R, m)).astype(np.float32),
        "step": np.arange(R, dtype=np.int32),
    }


@pytest.mark.parametrize("rank", [3, 8])
def test_powersgd_exact_when_rank_covers(rank):
    g = low_rank_grads(0)
    tx = jaxsync.powersgd_mean(axis_name="i", comm=None, rank=rank, min_compression_rate=0.0)
    init, update = vmapped(tx)
    state = init(jax.tree.map(jnp.asarray, g))
    assert len(state.q) == 3  # w and both convs compressed; bias, step exact
    out, state = update(jax.tree.map(jnp.asarray, g), state)
    for name in ("w", "conv", "oihw", "bias"):
        want = g[name].astype(np.float64).mean(0)
        got = np.asarray(out[name])
        scale = np.abs(want).max()
        np.testing.assert_allclose(got[0], want, rtol=0, atol=2e-5 * scale, err_msg=name)
        assert (bits(got) == bits(got[:1])).all(), f"{name}: replicas differ"
    np.testing.assert_array_equal(np.asarray(out["step"]), g["step"])  # passes through
    # The residual is each replica's deviation from the mean.
    want_res = g["w"] - g["w"].astype(np.float64).mean(0)
    # compressed leaves in tree order: conv, oihw, w
    np.testing.assert_allclose(
        np.asarray(state.residual[2]), want_res, rtol=0, atol=2e-5 * np.abs(g["w"]).max()
    )


def test_powersgd_low_rank_is_not_exact():
    """Control for the test above: rank 1 < the mean's rank 3 loses information."""
    g = jax.tree.map(jnp.asarray, low_rank_grads(0))
    tx = jaxsync.powersgd_mean(axis_name="i", comm=None, rank=1, min_compression_rate=0.0)
    init, update = vmapped(tx)
    out, _ = update(g, init(g))
    err = np.abs(np.asarray(out["w"][0]) - np.asarray(g["w"]).mean(0)).max()
    assert err > 1e-2 * np.abs(np.asarray(g["w"])).max()


def run_steps(tx, steps, seed=1, shape=(32, 16)):
    """Random gradients (replicas differ, around a full-rank mean that rank 1
    cannot carry in one step). Returns the norm of ``sum(applied) - sum(true
    means)`` after every step, its last value, and the last state."""
    init, update = vmapped(tx)
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(shape)
    state = init({"w": jnp.zeros((R, *shape))})
    drift = np.zeros(shape)
    norms = []
    for _ in range(steps):
        g = (base + 0.5 * rng.standard_normal((R, *shape))).astype(np.float32)
        out, state = update({"w": jnp.asarray(g)}, state)
        o = np.asarray(out["w"])
        assert (bits(o) == bits(o[:1])).all(), "replicas differ"
        drift += o[0] - g.astype(np.float64).mean(0)
        norms.append(np.linalg.norm(drift))
    return norms, drift, state


@pytest.mark.parametrize(
    "make",
    [
        lambda ef: jaxsync.powersgd_mean(axis_name="i", comm=None, rank=1, error_feedback=ef),
        lambda ef: jaxsync.sign_mean(axis_name="i", comm=None, min_size=1, error_feedback=ef),
    ],
    ids=["powersgd", "sign"],
)
def test_error_feedback_tracks_the_true_sum(make):
    """sum(applied) = sum(true means) - mean(residual): the drift is the mean
    residual, and it stops growing; without feedback it grows linearly."""
    steps = 120
    norms, drift, state = run_steps(make(True), steps)
    mean_res = np.asarray(state.residual[0], np.float64).mean(0)
    np.testing.assert_allclose(drift, -mean_res, rtol=0, atol=1e-3)
    plain, _, _ = run_steps(make(False), steps)
    # Observed (120 steps): powersgd 239 vs 2254 without feedback, sign 185 vs
    # 1140; from step 60 to 120 the drift grows 1.16x / 1.4x with feedback,
    # 2.0x without.
    assert norms[-1] < 0.25 * plain[-1], (norms[-1], plain[-1])
    assert norms[-1] < 1.6 * norms[steps // 2 - 1], norms[::10]
    assert plain[-1] > 1.9 * plain[steps // 2 - 1], plain[::10]


# --------------------------------------------------------------------------
# start_step, warm start


def test_powersgd_before_start_step_is_hierarchical_mean():
    rng = np.random.default_rng(2)
    tx = jaxsync.powersgd_mean(axis_name="i", comm=None, start_step=3)
    ref = jaxsync.hierarchical_mean(axis_name="i", comm=None)
    init, update = vmapped(tx)
    ref_update = jax.jit(jax.vmap(lambda g: ref.update(g, ref.init(g))[0], axis_name="i"))
    state = init({"w": jnp.zeros((R, 64, 32)), "b": jnp.zeros((R, 32))})
    for step in range(5):
        g = {
            "w": jnp.asarray(rng.standard_normal((R, 64, 32)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal((R, 32)), jnp.float32),
        }
        out, state = update(g, state)
        want = ref_update(g)
        same = (bits(out["w"]) == bits(want["w"])).all()
        assert same == (step < 3), step  # exact before, compressed from step 3
        assert (bits(out["b"]) == bits(want["b"])).all()
        res = np.asarray(state.residual[0])
        assert (res == 0).all() == (step < 3), step
    assert int(state.count[0]) == 5


def test_powersgd_warm_start_keeps_q():
    g = jax.tree.map(jnp.asarray, low_rank_grads(3))
    for warm in (True, False):
        tx = jaxsync.powersgd_mean(
            axis_name="i", comm=None, warm_start=warm, min_compression_rate=0.0
        )
        init, update = vmapped(tx)
        s0 = init(g)
        _, s1 = update(g, s0)
        changed = not np.array_equal(np.asarray(s1.q[0]), np.asarray(s0.q[0]))
        assert changed == warm


# --------------------------------------------------------------------------
# sign_mean: exact by construction, packing


def test_pack_signs_round_trip():
    x = jnp.asarray(np.random.default_rng(4).standard_normal(21), jnp.float32)
    x = x.at[3].set(0.0).at[4].set(-0.0)
    packed = _sign.pack_signs(x)
    assert packed.dtype == jnp.uint8 and packed.shape == (3,)
    want = np.where(np.asarray(x) >= 0, 1.0, -1.0)
    np.testing.assert_array_equal(np.asarray(_sign.unpack_signs(packed, 21)), want)
    # bit 7 of byte 0 is element 0
    assert int(packed[0]) >> 7 == int(x[0] >= 0)


def test_sign_exact_by_construction():
    """Replica r sends +-(r+1) on every element of a leaf (|p| constant): the
    scaled sign is the value itself and the mean is exact; other leaves exact."""
    signs = np.where(np.arange(40).reshape(8, 5) % 3 == 0, 1.0, -1.0)
    w = np.stack([(r + 1) * signs * (-1) ** r for r in range(R)]).astype(np.float32)
    g = {"w": jnp.asarray(w), "b": jnp.asarray(np.arange(R * 3.0).reshape(R, 3), jnp.float32)}
    tx = jaxsync.sign_mean(axis_name="i", comm=None, min_size=8)
    init, update = vmapped(tx)
    state = init(g)
    assert len(state.residual) == 1  # b has 3 < 8 values: exact
    out, state = update(g, state)
    want = np.broadcast_to(w.mean(0), w.shape)
    assert (bits(out["w"]) == bits(want.astype(np.float32))).all()
    assert (
        bits(out["b"])
        == bits(
            np.broadcast_to(np.arange(R * 3.0).reshape(R, 3).mean(0), (R, 3)).astype(np.float32)
        )
    ).all()
    assert (np.asarray(state.residual[0]) == 0).all()


# --------------------------------------------------------------------------
# Both stages in one process: (host=2, local=4) mesh, AxisComm("host"),
# shard_map with state_specs; replicated parameters (autodiff already summed).


@pytest.mark.parametrize(
    "make",
    [
        lambda: jaxsync.powersgd_mean(
            axis_name="local", comm=jaxsync.AxisComm("host"), rank=2, start_step=2
        ),
        lambda: jaxsync.sign_mean(axis_name="local", comm=jaxsync.AxisComm("host"), min_size=16),
    ],
    ids=["powersgd", "sign"],
)
def test_mesh_two_stages_with_state_specs(make):
    tx = optax.chain(make(), optax.sgd(0.05))
    params = {"w": jnp.ones((16, 8)), "b": jnp.zeros(8)}

    def loss(p, x, y):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    specs = jaxsync.state_specs(jax.eval_shape(tx.init, params), ("host", "local"))
    state = jax.jit(jax.shard_map(tx.init, mesh=MESH2, in_specs=P(), out_specs=specs))(params)

    def step(p, s, x, y):
        # per-device copies of the parameters: per-device gradients
        pv = jax.tree.map(lambda a: jax.lax.pcast(a, ("host", "local"), to="varying"), p)
        g = jax.grad(loss)(pv, x, y)
        u, s = tx.update(g, s, p)
        new = optax.apply_updates(p, u)
        # every device's own copy, to compare them bitwise
        mine = jax.tree.map(lambda a: jax.lax.pcast(a, ("host", "local"), to="varying")[None], new)
        return new, s, mine

    data = P(("host", "local"))
    f = jax.jit(
        jax.shard_map(
            step, mesh=MESH2, in_specs=(P(), specs, data, data), out_specs=(P(), specs, data)
        )
    )
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((64, 8)), jnp.float32)
    l0 = float(loss(params, x, y))
    p, s = params, state
    for _ in range(20):
        p, s, every = f(p, s, x, y)
        for leaf in jax.tree.leaves(every):  # every device's copy, bitwise equal
            assert (bits(leaf) == bits(leaf[:1])).all()
    assert s[0].residual[0].shape == (8 * 16, 8)  # one residual per device, stacked
    assert float(loss(p, x, y)) < 0.7 * l0


# --------------------------------------------------------------------------
# Checkpoint round trip (in process; under MPI in tests/mpi)


@pytest.mark.parametrize(
    "make",
    [
        lambda: jaxsync.powersgd_mean(
            axis_name="i", comm=None, rank=2, min_compression_rate=0.0, start_step=1
        ),
        lambda: jaxsync.sign_mean(axis_name="i", comm=None, min_size=1),
    ],
    ids=["powersgd", "sign"],
)
def test_checkpoint_round_trip_is_bit_identical(make):
    tx = optax.chain(make(), optax.sgd(0.1, momentum=0.9))
    init, update = vmapped(tx)
    rng = np.random.default_rng(6)
    grads = [
        {
            "w": jnp.asarray(rng.standard_normal((R, 12, 6)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal((R, 6)), jnp.float32),
        }
        for _ in range(8)
    ]
    state = init(grads[0])
    outs = []
    for g in grads:
        out, state = update(g, state)
        outs.append(out)
    # again, saving and restoring the state (numpy.savez) after step 4
    state = init(grads[0])
    for g in grads[:4]:
        _, state = update(g, state)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    buf = io.BytesIO()
    np.savez(buf, *[np.asarray(x) for x in leaves])
    buf.seek(0)
    with np.load(buf) as z:
        restored = jax.tree_util.tree_unflatten(
            treedef, [jnp.asarray(z[f"arr_{i}"]) for i in range(len(leaves))]
        )
    for k, g in enumerate(grads[4:], start=4):
        out, restored = update(g, restored)
        for name in ("w", "b"):
            assert (bits(out[name]) == bits(outs[k][name])).all(), (k, name)
    assert not np.allclose(np.asarray(outs[-1]["w"]), 0)


# --------------------------------------------------------------------------
# Convergence on digits, same seeds as the uncompressed run


def test_convergence_on_digits_within_one_point():
    # optax.adam's bias correction mixes a Python float with int32 counts.
    with jax.numpy_dtype_promotion("standard"):
        _, exact = digits.train(jaxsync.hierarchical_mean(axis_name="i", comm=None))
        _, psgd = digits.train(jaxsync.powersgd_mean(axis_name="i", comm=None, rank=4))
        _, sign = digits.train(jaxsync.sign_mean(axis_name="i", comm=None))
    base = exact[-1][2]
    assert base > 0.95, exact
    for name, curve in (("powersgd rank 4", psgd), ("sign", sign)):
        assert abs(curve[-1][2] - base) <= 0.01, (name, curve[-1], exact[-1])


# --------------------------------------------------------------------------
# Per-leaf policy with optax.partition (the README's example)


def test_partition_policy_and_state_specs():
    def label(params):
        def one(path, x):
            name = jax.tree_util.keystr(path)
            if "embed" in name:
                return "sign"
            return "powersgd" if x.ndim >= 2 else "exact"

        return jax.tree_util.tree_map_with_path(one, params)

    sync = optax.partition(
        {
            "powersgd": jaxsync.powersgd_mean(axis_name="i", comm=None, rank=2),
            "sign": jaxsync.sign_mean(axis_name="i", comm=None),
            "exact": jaxsync.hierarchical_mean(axis_name="i", comm=None),
        },
        label,
    )
    rng = np.random.default_rng(7)
    g = {
        "embed": rng.standard_normal((R, 100, 8)),
        "dense": rng.standard_normal((R, 32, 16)),
        "norm": rng.standard_normal((R, 16)),
    }
    g = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), g)
    init, update = vmapped(sync)
    state = init(g)
    out, state = update(g, state)
    ref = jaxsync.hierarchical_mean(axis_name="i", comm=None)
    want = jax.vmap(lambda t: ref.update(t, ref.init(t))[0], axis_name="i")(g)
    assert (bits(out["norm"]) == bits(want["norm"])).all()  # exact
    for name in ("embed", "dense"):  # compressed
        assert not np.allclose(np.asarray(out[name]), np.asarray(want[name]), atol=1e-3)
        assert (bits(out[name]) == bits(out[name][:1])).all()
    specs = jaxsync.state_specs(jax.eval_shape(sync.init, jax.tree.map(lambda a: a[0], g)), "local")
    flat = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    assert flat.count(P("local")) == 2 and all(s in (P(), P("local")) for s in flat)


@pytest.mark.parametrize(
    "make",
    [
        lambda: jaxsync.powersgd_mean(axis_name="i", comm=None, rank=2),
        lambda: jaxsync.sign_mean(axis_name="i", comm=None, min_size=1),
    ],
    ids=["powersgd", "sign"],
)
def test_bfloat16_leaves_keep_their_dtype_with_float32_residuals(make):
    tx = make()
    init, update = vmapped(tx)
    rng = np.random.default_rng(8)
    g = {"w": jnp.asarray(rng.standard_normal((R, 32, 16)), jnp.bfloat16)}
    state = init(g)
    out, state = update(g, state)
    assert out["w"].dtype == jnp.bfloat16 and state.residual[0].dtype == jnp.float32
    assert (bits(out["w"]) == bits(out["w"][:1])).all()
    # the update points along the mean gradient
    mean = np.asarray(g["w"], np.float64).mean(0)
    assert np.sum(np.asarray(out["w"][0], np.float64) * mean) > 0


@pytest.mark.parametrize(
    "make",
    [
        lambda: jaxsync.powersgd_mean(axis_name=None, comm=None),
        lambda: jaxsync.sign_mean(axis_name=None, comm=None, min_size=1),
    ],
    ids=["powersgd", "sign"],
)
def test_row_sparse_leaves_are_refused(make):
    tx = make()
    dense = {"w": jnp.ones((64, 64))}
    state = tx.init(dense)
    g = {
        "w": jnp.ones((64, 64)),
        "emb": jaxsync.RowSparse(jnp.array([1, 3]), jnp.ones((2, 4)), num_rows=10),
    }
    with pytest.raises(TypeError, match="RowSparse.*optax.partition"):
        tx.update(g, state)


# --------------------------------------------------------------------------
# Wrong or foreign states, scalar leaves, NNX states (issue 27)


def test_scalar_leaf_under_shard_map():
    """A rank-0 leaf (a learnable temperature) has a (1,) residual per device, so
    state_specs' P(axis) stacks them: exact by construction (|p| is the scale)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("d",))
    tx = jaxsync.sign_mean(axis_name="d", comm=None, min_size=1)
    params = {"t": jnp.float32(0.0)}
    specs = jaxsync.state_specs(jax.eval_shape(tx.init, params), "d")
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

    def step(x, s):
        return tx.update({"t": x[0]}, s)

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("d"), specs), out_specs=(P(), specs)))
    out, state = f(jnp.arange(1.0, 5.0), state)  # replicas send 1, 2, 3, 4: mean 2.5
    assert bits(out["t"]) == bits(jnp.float32(2.5))
    assert state.residual[0].shape == (4,)
    assert (bits(state.residual[0]) == bits(jnp.zeros(4))).all()


@pytest.mark.parametrize(
    "make",
    [
        lambda: jaxsync.powersgd_mean(axis_name=None, comm=None, min_compression_rate=0.0),
        lambda: jaxsync.sign_mean(axis_name=None, comm=None, min_size=1),
    ],
    ids=["powersgd", "sign"],
)
def test_state_for_another_shape_raises_at_trace_time(make):
    tx = make()
    state = tx.init({"w": jnp.zeros((8, 4))})
    g = {"w": jax.ShapeDtypeStruct((4, 8), jnp.float32)}
    with pytest.raises(ValueError, match=r"residual of \['w'\] has shape \(8, 4\)") as e:
        jax.eval_shape(tx.update, g, state)  # static: no value is computed
    assert "needs (4, 8)" in str(e.value) and "Fix: call init" in str(e.value)


@pytest.mark.parametrize(
    "make",
    [
        lambda: jaxsync.powersgd_mean(axis_name="d", comm=None, min_compression_rate=0.0),
        lambda: jaxsync.sign_mean(axis_name="d", comm=None, min_size=1),
    ],
    ids=["powersgd", "sign"],
)
def test_state_made_outside_shard_map_names_the_fix(make):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
    tx = make()
    params = {"w": jnp.ones((16, 32))}
    specs = jaxsync.state_specs(jax.eval_shape(tx.init, params), "d")
    f = jax.jit(jax.shard_map(tx.update, mesh=mesh, in_specs=(P(), specs), out_specs=(P(), specs)))
    with pytest.raises(ValueError, match="made outside shard_map") as e:
        f(params, tx.init(params))  # one residual for both devices, split by P("d")
    assert "(8, 32)" in str(e.value) and "state_specs" in str(e.value)
    assert "out_specs=specs" in str(e.value)


@pytest.mark.parametrize(
    "make",
    [
        lambda: jaxsync.powersgd_mean(axis_name="i", comm=None, rank=1, min_compression_rate=0.0),
        lambda: jaxsync.sign_mean(axis_name="i", comm=None, min_size=1),
    ],
    ids=["powersgd", "sign"],
)
def test_residuals_of_another_process_are_dropped(make):
    """A state recording another owner (a checkpoint restored on another rank)
    updates exactly as with zero residuals; then it is this process's own."""
    tx = make()
    init, update = vmapped(tx)
    rng = np.random.default_rng(8)
    g = [{"w": jnp.asarray(rng.integers(-4, 5, (R, 6, 4)), jnp.float32)} for _ in range(2)]
    _, own = update(g[0], init(g[0]))
    assert (np.asarray(own.owner) == 0).all()
    foreign = own._replace(owner=jnp.full((R,), 1, jnp.int32))
    fresh = own._replace(residual=jax.tree.map(jnp.zeros_like, own.residual))
    assert not all((bits(a) == 0).all() for a in own.residual)  # something to drop
    out_f, next_f = update(g[1], foreign)
    out_z, next_z = update(g[1], fresh)
    for a, b in zip(jax.tree.leaves((out_f, next_f)), jax.tree.leaves((out_z, next_z))):
        assert (bits(a) == bits(b)).all()
    assert (np.asarray(next_f.owner) == 0).all()


def test_state_specs_finds_the_residuals_in_an_nnx_state():
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(4, 3, rngs=rngs)
            self.temperature = nnx.Param(jnp.float32(1.0))

    tx = optax.chain(
        jaxsync.powersgd_mean(axis_name="d", comm=None, rank=1, min_compression_rate=0.0),
        jaxsync.sign_mean(axis_name="d", comm=None, min_size=1),
        optax.sgd(0.1),
    )
    opt = nnx.Optimizer(Model(nnx.Rngs(0)), tx, wrt=nnx.Param)
    state = nnx.state(opt)
    specs = jaxsync.state_specs(state, "d")
    got = {
        jax.tree_util.keystr(path): spec
        for path, spec in jax.tree_util.tree_flatten_with_path(
            specs, is_leaf=lambda x: isinstance(x, P)
        )[0]
    }
    residuals = {k for k in got if "'residual'" in k}
    # powersgd: the (4, 3) kernel; sign: kernel, bias and temperature
    assert len(residuals) == 4
    assert all(got[k] == P("d") for k in residuals)
    assert all(got[k] == P() for k in got if k not in residuals)

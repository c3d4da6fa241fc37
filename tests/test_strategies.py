"""Numerical tests of the five strategies in one process (8 fake CPU devices).

Reliability rows (the table in tests/_common.py) covered: 12 (many buckets and several syncs in
one step, no
recompilation), 13 (integer-valued gradients are exact; divisor = devices x
processes), 14 (random f32, bf16 and f16 vs a float64 reference within a stated ULP
bound), 15 (determinism, replicas bit-identical).

Layouts:
* ``shard_map`` / ``pmap`` / ``vmap``: 8 replicas on one axis ``"i"``, comm=None;
* ``axiscomm``: a (2, 4) mesh ("host", "local"), axis_name="local" and
  ``comm=AxisComm("host")`` - two simulated processes of four devices;
* ``axis_tuple``: the same mesh with ``axis_name=("host", "local")``, comm=None.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _common import HL, INTER, MESH1, MESH2, STRATEGIES, N, bits  # noqa: E402
from jax.sharding import PartitionSpec as P

import jaxsync


def make_tx(strategy, layout, **opts):
    fac = getattr(jaxsync, f"{strategy}_mean")
    if layout == "axiscomm":
        assert strategy != "single_node"
        return fac(axis_name="local", comm=jaxsync.AxisComm("host"), **opts)
    axis = HL if layout == "axis_tuple" else "i"
    if strategy == "single_node":
        return fac(axis_name=axis, **opts)
    return fac(axis_name=axis, comm=None, **opts)


def apply(tx, g):
    out, _ = tx.update(g, tx.init(g))
    return out


def mapped(fn, layout, jit=True):
    """Run per-replica ``fn`` on trees whose leaves have a leading replica axis."""
    if layout == "pmap":
        return jax.pmap(fn, axis_name="i")
    if layout == "vmap":
        f = jax.vmap(fn, axis_name="i")
        return jax.jit(f) if jit else f
    mesh, spec = (MESH1, P("i")) if layout == "shard_map" else (MESH2, P(HL))

    def per_device(tree):
        out = fn(jax.tree.map(lambda x: x[0], tree))
        return jax.tree.map(lambda x: x[None], out)

    f = jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec)
    return jax.jit(f) if jit else f


def ulp32(x) -> np.ndarray:
    return np.spacing(np.abs(np.asarray(x, np.float32)))


def ulp(x, dtype) -> np.ndarray:
    """The spacing of ``dtype`` numbers at |x| (normal range; float64 result)."""
    fi = jnp.finfo(dtype)
    x = np.maximum(np.abs(np.asarray(x, np.float64)), float(fi.tiny))
    return np.exp2(np.floor(np.log2(x)) - fi.nmant)


def mean_bound(m, dtype, n=N) -> np.ndarray:
    """|computed mean - exact mean| for n terms of magnitude <= m, stored as dtype.

    Float32: any order of the n - 1 float32 adds costs <= (n - 1) u32 n m on the
    sum (u32 = 2^-24), <= (n - 1) ulp32(m) on the mean, plus half an ulp for the
    final rounding. 16-bit data is summed in float32; rounding a partial sum
    (<= n m) to the 16-bit dtype costs <= ulp16(m) / 2 on the mean, and there are
    at most three such roundings (intra sum, inter sum, mean) - or two and the
    float16 predivide (n roundings of x / n, <= ulp16(m) / 2 together): 2 ulp16(m).
    """
    b = (n - 1 + 0.5) * ulp(m, jnp.float32)
    if jnp.dtype(dtype).itemsize == 2:
        b = b + 2 * ulp(m, dtype)
    return b


# ----------------------------------------------------------------------------
# row 13: integer-valued data, exact closed form
# ----------------------------------------------------------------------------

LEAF_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
LEAF_SHAPES = [(), (3,), (2, 3), (1,), (4, 1, 2), (5,)]  # two leaves of each dtype


def integer_tree():
    """Leaf k on replica d holds d + k, for dtypes cycling f32, bf16, f16.

    Plus an int32 leaf (passes through unreduced) and a zero-size leaf.
    """
    d = np.arange(N, dtype=np.float64)
    tree = {}
    for k, shape in enumerate(LEAF_SHAPES):
        dt = LEAF_DTYPES[k % 3]
        vals = np.broadcast_to((d + k).reshape((N,) + (1,) * len(shape)), (N,) + shape)
        tree[f"k{k}"] = jnp.asarray(vals, dt)
    tree["step"] = jnp.arange(N, dtype=jnp.int32) * 10
    tree["empty"] = jnp.zeros((N, 0), jnp.float32)
    return tree


def check_closed_form(out, tree, reduce):
    for k in range(len(LEAF_SHAPES)):
        name = f"k{k}"
        x, y = tree[name], out[name]
        assert y.dtype == x.dtype, f"{name}: dtype {y.dtype} != {x.dtype}"
        assert y.shape == x.shape, f"{name}: shape {y.shape} != {x.shape}"
        want = (N - 1) / 2 + k if reduce == "mean" else N * (N - 1) / 2 + N * k
        want = np.full(x.shape, want, np.float64).astype(x.dtype)  # exactly representable
        assert np.array_equal(bits(y), bits(want)), (
            f"{name} ({x.dtype}): got {np.asarray(y).ravel()[:8]}, want {want.ravel()[0]}"
        )
    # pass-through leaves are not reduced: each replica keeps its own value
    assert np.array_equal(np.asarray(out["step"]), np.asarray(tree["step"]))
    assert out["step"].dtype == jnp.int32
    assert out["empty"].shape == (N, 0)


LAYOUT_CASES = (
    [(s, lay) for lay in ("shard_map", "pmap", "vmap") for s in STRATEGIES]
    + [(s, "axiscomm") for s in INTER]
    + [(s, "axis_tuple") for s in STRATEGIES]
)


@pytest.mark.parametrize("strategy,layout", LAYOUT_CASES)
def test_integer_valued_exact(strategy, layout):
    tx_mean = make_tx(strategy, layout)
    tx_sum = make_tx(strategy, layout, reduce="sum")
    tree = integer_tree()
    mean, total = mapped(lambda g: (apply(tx_mean, g), apply(tx_sum, g)), layout)(tree)
    check_closed_form(mean, tree, "mean")
    check_closed_form(total, tree, "sum")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sync_gradients_function_matches_closed_form(strategy):
    tree = integer_tree()
    f = lambda g: jaxsync.sync_gradients(g, axis_name="i", strategy=strategy, comm=None)
    check_closed_form(mapped(f, "shard_map")(tree), tree, "mean")


# ----------------------------------------------------------------------------
# row 14: random f32 data vs a float64 reference
# ----------------------------------------------------------------------------


def random_tree(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "big": jnp.asarray(rng.standard_normal((N, 6, 5)) * 1e3, jnp.float32),
        "mixed": jnp.asarray(
            rng.standard_normal((N, 37)) * 10.0 ** rng.integers(-3, 4, (N, 37)), jnp.float32
        ),
        "cancel": jnp.asarray(
            np.concatenate([np.full((N // 2, 11), 1.0), np.full((N // 2, 11), -1.0)])
            + rng.standard_normal((N, 11)) * 1e-4,
            jnp.float32,
        ),
        "scalar": jnp.asarray(rng.standard_normal(N), jnp.float32),
        # 256 KiB + 12 bytes: above the default pack_threshold, so every strategy but
        # flat sends it in a buffer of its own
        "large": jnp.asarray(rng.standard_normal((N, 2**16 + 3)), jnp.float32),
    }


def all_strategies_fn(layout, strategies, **opts):
    txs = {s: make_tx(s, layout, **opts) for s in strategies}
    return mapped(lambda g: {s: apply(tx, g) for s, tx in txs.items()}, layout)


RANDOM_LAYOUTS = [("shard_map", STRATEGIES), ("axiscomm", INTER), ("axis_tuple", STRATEGIES)]


@pytest.mark.parametrize(
    "layout,strategies", RANDOM_LAYOUTS, ids=[name for name, _ in RANDOM_LAYOUTS]
)
def test_random_f32_within_ulp_bound_of_float64_reference(layout, strategies):
    tree = random_tree()
    outs = all_strategies_fn(layout, strategies)(tree)
    for name, x in tree.items():
        x64 = np.asarray(x, np.float64)
        ref = x64.mean(axis=0)
        # Bound: any summation order of n f32 terms has |error| <= (n-1) u sum|x_i|
        # (u = 2^-24); dividing by n = 8 is exact, the final rounding adds <= ulp/2.
        # With sum|x_i| <= n max|x_i| and ulp(M) >= 2^-24 M this is
        #   |mean_f32 - mean_f64| <= (n - 1 + 0.5) ulp(M) <= 8 ulp(M),  M = max_i |x_i|
        # per element. We assert the 8-ULP-of-M bound.
        bound = 8 * ulp32(np.abs(x64).max(axis=0))
        for s in strategies:
            got = np.asarray(outs[s][name])
            assert got.dtype == np.float32
            err = np.abs(got.astype(np.float64) - ref[None])
            assert np.all(err <= bound[None]), (
                f"{s}/{name}: error {np.max(err / bound[None]) * 8:.2f} ULP(M) > 8"
            )
            for r in range(1, N):
                assert np.array_equal(bits(got[r]), bits(got[0])), (
                    f"{s}/{name}: replica {r} differs from replica 0"
                )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
    "layout,strategies", RANDOM_LAYOUTS, ids=[name for name, _ in RANDOM_LAYOUTS]
)
def test_strategies_within_ulp_of_float64_reference(layout, strategies, dtype):
    """Every strategy against an independent numpy float64 mean (not against
    another strategy of the library), at a tolerance from the dtype's ULP."""
    tree = {
        k: v.astype(dtype)
        for k, v in random_tree(seed=3).items()
        if k != "large" or dtype == jnp.float32
    }
    outs = all_strategies_fn(layout, strategies)(tree)
    for name, x in tree.items():
        x64 = np.asarray(x.astype(jnp.float32), np.float64)  # exact
        ref = x64.mean(axis=0)
        bound = mean_bound(np.abs(x64).max(axis=0), dtype)
        for s in strategies:
            got = np.asarray(outs[s][name])
            assert got.dtype == jnp.dtype(dtype), f"{s}/{name}: dtype {got.dtype}"
            err = np.abs(got.astype(np.float64) - ref[None])
            assert np.all(err <= bound[None]), (
                f"{s}/{name} ({jnp.dtype(dtype)}): error {np.max(err / bound[None]):.2f} x bound"
            )


# ----------------------------------------------------------------------------
# low-precision transport
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layout,strategies",
    [("shard_map", STRATEGIES), ("axiscomm", INTER)],
    ids=["shard_map", "axiscomm"],
)
def test_comm_dtype_bfloat16_on_f32_data(layout, strategies):
    rng = np.random.default_rng(5)
    d = np.arange(N, dtype=np.float64)[:, None]
    tree = {
        "rand": jnp.asarray(rng.standard_normal((N, 40)), jnp.float32),
        "ints": jnp.asarray(d + np.arange(5)[None], jnp.float32),
    }
    outs = all_strategies_fn(layout, strategies, comm_dtype=jnp.bfloat16)(tree)
    x64 = np.asarray(tree["rand"], np.float64)
    ref = x64.mean(axis=0)
    M = np.abs(x64).max(axis=0)
    for s in strategies:
        r = np.asarray(outs[s]["rand"])
        assert r.dtype == np.float32 and r.shape == (N, 40), f"{s}: dtype/shape not kept"
        # bf16 has 8 significant bits (u = 2^-9). Rounding each input costs <= u M on the
        # mean; each of the <= 2 rounding stages of a partial/total sum (intra, inter)
        # costs <= u M more (|partial sum| / n <= M). Bound: 3 u M.
        err = np.abs(r - ref[None])
        assert np.all(err <= 3 * 2.0**-9 * M[None]), f"{s}: bf16 error too large"
        # The sum really travelled in bf16: N * result is a bf16 number (the division by
        # N = 8 is exact), and it is not the f32 result.
        scaled = r * np.float32(N)
        assert np.array_equal(scaled.astype(jnp.bfloat16).astype(np.float32), scaled), (
            f"{s}: sum was not rounded to bfloat16 (comm_dtype ignored?)"
        )
        assert not np.array_equal(r[0], ref.astype(np.float32)), f"{s}: no bf16 rounding at all"
        # small integer-valued data is exact: mean of d + k is 3.5 + k
        want = (N - 1) / 2 + np.arange(5, dtype=np.float32)
        assert np.array_equal(np.asarray(outs[s]["ints"]), np.broadcast_to(want, (N, 5))), s


# ----------------------------------------------------------------------------
# row 12: many buckets, several syncs per step, no recompilation
# ----------------------------------------------------------------------------


def bucket_tree(seed=7):
    rng = np.random.default_rng(seed)
    tree = {}
    for k, (shape, dt) in enumerate(
        [
            ((3,), jnp.float32),
            ((2, 2), jnp.bfloat16),
            ((5,), jnp.float32),
            ((1,), jnp.float16),
            ((), jnp.float32),
            ((6,), jnp.float16),
        ]
    ):
        tree[f"l{k}"] = jnp.asarray(rng.standard_normal((N,) + shape), dt)
    return tree


# naive is left out: it always uses one buffer per leaf, whatever bucket_bytes says.
BUCKET_CASES = [(s, "shard_map") for s in STRATEGIES if s != "naive"] + [
    ("hierarchical", "axiscomm"),
    ("two_dimensional", "axiscomm"),
]


@pytest.mark.parametrize("strategy,layout", BUCKET_CASES)
def test_many_buckets_identical_to_one_bucket(strategy, layout):
    tree = bucket_tree()
    one = dict(bucket_bytes=None, pack_threshold=None)
    many = dict(bucket_bytes=1, pack_threshold=None)
    per_replica = jax.tree.map(lambda x: x[0], tree)
    assert len(jaxsync.make_plan(per_replica, **one).buckets) == 3  # one per dtype
    assert len(jaxsync.make_plan(per_replica, **many).buckets) == len(tree)
    tx1, txm = make_tx(strategy, layout, **one), make_tx(strategy, layout, **many)
    a, b = mapped(lambda g: (apply(tx1, g), apply(txm, g)), layout)(tree)
    for name, x in tree.items():
        assert np.array_equal(bits(a[name]), bits(b[name])), f"{layout}/{name}"
        # and both are the mean of an independent float64 reference, within a
        # tolerance from the leaf's own dtype (f32 leaves: f32 ULPs, not 2^-4)
        x64 = np.asarray(x.astype(jnp.float32), np.float64)
        bound = mean_bound(np.abs(x64).max(axis=0), x.dtype)
        err = np.abs(np.asarray(a[name][0].astype(jnp.float32), np.float64) - x64.mean(0))
        assert np.all(err <= bound), f"{layout}/{name} ({x.dtype}): {np.max(err / bound):.2f}"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_recompilation_on_second_step(strategy):
    traces = []
    tx = make_tx(strategy, "shard_map", bucket_bytes=8, check_finite=True)
    tx2 = make_tx(strategy, "shard_map", reduce="sum")

    def step(g):
        traces.append(1)
        out, state = tx.update(g, tx.init(g))
        out2 = apply(tx2, {"x": g["l0"] * jnp.float32(2)})  # a second sync in the same step
        return out, state.all_finite[None], out2

    f = mapped(step, "shard_map")
    results = [f(bucket_tree(seed)) for seed in (1, 2, 3)]
    assert len(traces) == 1, f"traced {len(traces)} times"
    assert f._cache_size() == 1
    # and the steps computed different (correct) things
    for seed, (out, finite, out2) in zip((1, 2, 3), results):
        ref = np.asarray(bucket_tree(seed)["l0"], np.float64)
        np.testing.assert_allclose(np.asarray(out["l0"][0]), ref.mean(0), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(out2["x"][0]), 2 * ref.sum(0), rtol=1e-6)
        assert np.all(np.asarray(finite))


# ----------------------------------------------------------------------------
# row 15: determinism
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layout,strategies",
    [("shard_map", STRATEGIES), ("axiscomm", INTER)],
    ids=["shard_map", "axiscomm"],
)
def test_training_steps_deterministic_and_replicas_identical(layout, strategies):
    """Each replica sees different gradients every step; after 3 SGD steps the
    parameters are bit-identical on every replica, and a second run (freshly
    traced and compiled) gives bit-identical parameters."""

    def build():
        txs = {s: optax.chain(make_tx(s, layout), optax.sgd(0.1)) for s in strategies}

        def run(params, noise):
            idx = jax.lax.axis_index(HL if layout == "axiscomm" else "i")
            states = {s: tx.init(params) for s, tx in txs.items()}
            ps = {s: params for s in strategies}
            for step in range(3):
                for s, tx in txs.items():
                    g = jax.tree.map(lambda p: p * noise[step] + idx.astype(jnp.float32), ps[s])
                    u, states[s] = tx.update(g, states[s], ps[s])
                    ps[s] = optax.apply_updates(ps[s], u)
            return ps

        return mapped(lambda a: run(a["params"], a["noise"]), layout)

    rng = np.random.default_rng(11)
    params = {"w": rng.standard_normal((3, 4)), "b": rng.standard_normal(4)}
    args = {
        "params": jax.tree.map(
            lambda p: jnp.asarray(np.broadcast_to(p, (N,) + p.shape), jnp.float32), params
        ),
        "noise": jnp.asarray(rng.standard_normal((N, 3)), jnp.float32),
    }
    first = build()(args)
    second = build()(args)
    for s in strategies:
        for k in ("w", "b"):
            a, b = np.asarray(first[s][k]), np.asarray(second[s][k])
            assert np.array_equal(bits(a), bits(b)), f"{s}/{k}: two runs differ"
            for r in range(1, N):
                assert np.array_equal(bits(a[r]), bits(a[0])), f"{s}/{k}: replica {r} diverged"
            assert not np.array_equal(a[0], np.asarray(args["params"][k][0])), "no update happened"


def test_the_intra_all_gather_is_typed_replicated_on_this_jax():
    """The all-gather that ends two_dimensional's intra stage is typed replicated
    under shard_map's check_vma, so an out_specs of P() takes its result (jax
    0.11-0.12 renamed JAX's invariant all-gather; the plain one is typed varying,
    and every two_dimensional sync across processes failed to trace there)."""
    from jax.sharding import Mesh

    from jaxsync._comm import _intra

    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    ops = _intra.AxisOps(("d",))

    def f(x):
        return ops.allgather_tiled(x), ops.allgather(x)

    tiled, stacked = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=P()))(
        jnp.arange(4.0)
    )
    np.testing.assert_array_equal(tiled, np.arange(4.0))
    np.testing.assert_array_equal(stacked, np.arange(4.0).reshape(2, 2))


@pytest.mark.parametrize(
    "factory", ["naive_mean", "flat_mean", "hierarchical_mean", "two_dimensional_mean"]
)
def test_nested_vmap_with_a_tuple_of_axes(factory):
    """vmap(vmap(...)) with axis_name=("a", "b"): JAX's vmap rules refuse a
    psum_scatter / all_gather over two axes at once ("axis size doesn't match";
    two_dimensional_mean raised it); jaxsync then runs them one axis at a time.
    Exact: integer values, the mean over 6 replicas a multiple of 1/2; the same
    bits as one vmap over the 6 replicas."""
    tx = getattr(jaxsync, factory)(axis_name=("a", "b"), comm=None, bucket_bytes=None)
    g = {
        "w": jnp.arange(2 * 3 * 7, dtype=jnp.float32).reshape(2, 3, 7),
        "h": (jnp.arange(6, dtype=jnp.float32).reshape(2, 3, 1) * jnp.ones(5)).astype(jnp.bfloat16),
    }
    step = lambda t: tx.update(t, tx.init(t))[0]
    out = jax.vmap(jax.vmap(step, axis_name="b"), axis_name="a")(g)
    one = getattr(jaxsync, factory)(axis_name="r", comm=None, bucket_bytes=None)
    ref = jax.vmap(lambda t: one.update(t, one.init(t))[0], axis_name="r")(
        jax.tree.map(lambda x: x.reshape(6, *x.shape[2:]), g)
    )
    for k in g:
        want = np.asarray(g[k], np.float64).reshape(6, -1).mean(0)
        got = np.asarray(out[k], np.float64).reshape(6, -1)
        assert (got == want).all(), (k, got[0], want)
        assert (
            np.asarray(out[k]).reshape(6, -1).tobytes()
            == np.asarray(ref[k]).reshape(6, -1).tobytes()
        )

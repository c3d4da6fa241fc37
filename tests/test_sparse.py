"""Row-sparse gradients (RowSparse): construction, sync, apply, agreement texts.

Exact by construction: replica ``r`` holds integer-valued rows at known
indices (with duplicates); the synced ``todense()`` must equal, bitwise, the
mean of every replica's scattered gradient computed in float64 by numpy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _common import raises_then_clean
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxsync
from jaxsync.sparse import _rows as _sparse

R = 8  # replicas (fake devices, tests/conftest.py)
V, D, K = 256, 3, 3
STRATEGIES = dict(
    naive=jaxsync.naive_mean,
    flat=jaxsync.flat_mean,
    hierarchical=jaxsync.hierarchical_mean,
    two_dimensional=jaxsync.two_dimensional_mean,
)


def rows(r, dtype=np.float32, v=V, k=K, d=D):
    """Replica r's indices (a duplicate included) and integer-valued rows."""
    idx = np.array([(3 * r) % v, (5 * r + 1) % v, (3 * r) % v][:k], np.int32)
    vals = (np.arange(k * d).reshape(k, d) % 7 + r + 1).astype(dtype)
    return idx, vals


def dense_of(idx, vals, v=V):
    out = np.zeros((v, *vals.shape[1:]), np.float64)
    np.add.at(out, idx, vals.astype(np.float64))
    return out


def expected_mean(n=R, dtype=np.float32, reduce="mean"):
    tot = sum(dense_of(*rows(r, dtype)) for r in range(n))
    return (tot / n if reduce == "mean" else tot).astype(dtype)


def stacked_tree(n=R):
    """Per-replica trees stacked on a leading axis: f32 and bf16 sparse + dense."""
    idx, vals = zip(*(rows(r) for r in range(n)))
    idx2, vals2 = zip(*(rows(r, jnp.bfloat16) for r in range(n)))
    w = np.stack([np.full((4,), r, np.float32) for r in range(n)])
    return {
        "emb": _sparse.RowSparse.tree_unflatten(
            V, (jnp.asarray(np.stack(idx)), jnp.asarray(np.stack(vals)))
        ),
        "emb16": _sparse.RowSparse.tree_unflatten(
            V, (jnp.asarray(np.stack(idx2)), jnp.asarray(np.stack(vals2)))
        ),
        "w": jnp.asarray(w),
    }


def bitwise(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (
        what,
        got.dtype,
        want.dtype,
        got.shape,
        want.shape,
    )
    assert got.tobytes() == want.tobytes(), f"{what}:\n{got}\n!=\n{want}"


def check_result(out, n=R, reduce="mean", opts=None):
    """``out``: stacked per-replica results; every replica must hold the answer."""
    opts = opts or jaxsync.SparseOptions()
    for name, dt in (("emb", np.float32), ("emb16", jnp.bfloat16)):
        want = expected_mean(n, dt, reduce)
        leaf = out[name]
        for r in range(n):
            if opts.densify or opts.mode_of(name) == "dense":
                assert not isinstance(leaf, jaxsync.RowSparse)
                got = np.asarray(leaf[r])
            else:
                assert isinstance(leaf, jaxsync.RowSparse), type(leaf)
                one = _sparse.RowSparse.tree_unflatten(V, (leaf.indices[r], leaf.values[r]))
                k = min(n * K, V) if opts.coalesce else n * K
                assert one.k == k, (one.k, k)
                if opts.coalesce:  # unique indices (padding: V)
                    i = np.asarray(one.indices)
                    assert len(set(i[i < V].tolist())) == (i < V).sum()
                got = np.asarray(one.todense())
            bitwise(got, want, f"{name} replica {r}")
    w = np.asarray(out["w"])
    want_w = np.full((4,), (n - 1) / 2 if reduce == "mean" else n * (n - 1) / 2, np.float32)
    for r in range(n):
        bitwise(w[r], want_w, f"w replica {r}")


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_vmap_every_strategy(strategy, reduce):
    tx = STRATEGIES[strategy](axis_name="i", comm=None, reduce=reduce)
    f = jax.jit(jax.vmap(lambda t: tx.update(t, tx.init(t))[0], axis_name="i"))
    check_result(f(stacked_tree()), reduce=reduce)


@pytest.mark.parametrize(
    "opts",
    [
        jaxsync.SparseOptions(coalesce=True),
        jaxsync.SparseOptions(densify=True),
        jaxsync.SparseOptions(mode={"emb": "dense"}),
        jaxsync.SparseOptions(mode="sparse", coalesce=True),
    ],
    ids=["coalesce", "densify", "emb-dense", "sparse-coalesce"],
)
def test_vmap_options(opts):
    tx = jaxsync.hierarchical_mean(axis_name="i", comm=None, sparse=opts)
    f = jax.jit(jax.vmap(lambda t: tx.update(t, tx.init(t))[0], axis_name="i"))
    check_result(f(stacked_tree()), opts=opts)


def test_single_node_and_sync_gradients():
    tx = jaxsync.single_node_mean(axis_name="i")
    f = jax.jit(jax.vmap(lambda t: tx.update(t, tx.init(t))[0], axis_name="i"))
    check_result(f(stacked_tree()))
    g = jax.jit(
        jax.vmap(lambda t: jaxsync.sync_gradients(t, axis_name="i", comm=None), axis_name="i")
    )
    check_result(g(stacked_tree()))


def test_pmap():
    tx = jaxsync.hierarchical_mean(axis_name="i", comm=None)
    f = jax.pmap(lambda t: tx.update(t, tx.init(t))[0], axis_name="i")
    check_result(f(stacked_tree()))


def _spec_tree(spec):
    return {
        "emb": _sparse.RowSparse.tree_unflatten(V, (spec, spec)),
        "emb16": _sparse.RowSparse.tree_unflatten(V, (spec, spec)),
        "w": spec,
    }


@pytest.mark.parametrize("strategy", ["hierarchical", "two_dimensional", "flat"])
@pytest.mark.parametrize("coalesce", [False, True])
def test_shard_map(strategy, coalesce):
    """Replicated result (out_specs=P()) under check_vma; the sparse rows per device."""
    mesh = Mesh(np.array(jax.devices()[:R]), ("i",))
    opts = jaxsync.SparseOptions(coalesce=coalesce)
    tx = STRATEGIES[strategy](axis_name="i", comm=None, sparse=opts)

    def step(t):
        t = jax.tree.map(lambda x: x[0], t)  # drop the per-device leading axis
        return tx.update(t, tx.init(t))[0]

    f = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(_spec_tree(P("i")),), out_specs=_spec_tree(P()))
    )
    out = f(stacked_tree())
    # Replicated output: one copy; restack it R times for check_result.
    out = jax.tree.map(lambda x: jnp.broadcast_to(x, (R, *x.shape)), out)
    check_result(out, opts=opts)


def test_shard_map_invariant_gradient_counted_once():
    """A RowSparse that autodiff already summed (invariant) is counted once."""
    mesh = Mesh(np.array(jax.devices()[:R]), ("i",))
    tx = jaxsync.hierarchical_mean(axis_name="i", comm=None)
    idx = jnp.array([1, 5], jnp.int32)

    def step(rows_in):
        # rows_in is replicated: jax.grad of it is summed over "i" (invariant).
        def loss(rw):
            return jnp.sum(rw * (jax.lax.axis_index("i") + 1).astype(jnp.float32))

        g = jax.grad(loss)(rows_in)
        out = tx.update(
            {"e": jaxsync.RowSparse(idx, g, V)}, tx.init({"e": jaxsync.RowSparse(idx, g, V)})
        )[0]
        return out["e"].todense()

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P(), out_specs=P()))
    got = np.asarray(f(jnp.ones((2, D))))
    want = np.zeros((V, D), np.float32)
    want[[1, 5]] = sum(range(1, R + 1)) / R  # the mean of the per-device gradients
    bitwise(got, want, "invariant sparse gradient")


def test_axis_comm():
    """2 simulated hosts x 4 local devices, the inter stage over the 'host' axis."""
    mesh = Mesh(np.array(jax.devices()[:R]).reshape(2, 4), ("host", "local"))
    for opts in (jaxsync.SparseOptions(), jaxsync.SparseOptions(coalesce=True)):
        tx = jaxsync.hierarchical_mean(
            axis_name="local", comm=jaxsync.AxisComm("host"), sparse=opts
        )

        def step(t, tx=tx):
            t = jax.tree.map(lambda x: x[0], t)
            return tx.update(t, tx.init(t))[0]

        spec = P(("host", "local"))
        f = jax.jit(
            jax.shard_map(step, mesh=mesh, in_specs=(_spec_tree(spec),), out_specs=_spec_tree(P()))
        )
        out = jax.tree.map(lambda x: jnp.broadcast_to(x, (R, *x.shape)), f(stacked_tree()))
        check_result(out, opts=opts)


def test_rank_major_order_and_size():
    """R*k rows, replica r's rows at [r*k, (r+1)*k), values divided by R."""
    tx = jaxsync.hierarchical_mean(
        axis_name="i", comm=None, sparse=jaxsync.SparseOptions(mode="sparse")
    )
    f = jax.jit(jax.vmap(lambda t: tx.update(t, tx.init(t))[0], axis_name="i"))
    out = f(stacked_tree())["emb"]
    assert out.indices.shape == (R, R * K) and out.values.shape == (R, R * K, D)
    for r in range(R):
        idx, vals = rows(r)
        bitwise(out.indices[0, r * K : (r + 1) * K], idx, f"indices of replica {r}")
        bitwise(out.values[0, r * K : (r + 1) * K], vals / np.float32(R), f"values {r}")


def test_auto_choice():
    g_small = jaxsync.RowSparse(jnp.zeros(4, jnp.int32), jnp.zeros((4, 8)), 1000)
    g_big = jaxsync.RowSparse(jnp.zeros(200, jnp.int32), jnp.zeros((200, 8)), 1000)
    # R*k*(32 + 4) < 1000*32 ?  4*8*36 = 1152 yes; 200*8*36 = 57600 no.
    assert _sparse.choose("auto", 8, g_small) == "sparse"
    assert _sparse.choose("auto", 8, g_big) == "dense"
    assert _sparse.choose("sparse", 8, g_big) == "sparse"
    # A big k goes dense automatically: the result is a dense array.
    tx = jaxsync.hierarchical_mean(axis_name="i", comm=None)
    tree = {
        "e": _sparse.RowSparse.tree_unflatten(
            4, (jnp.tile(jnp.arange(4, dtype=jnp.int32), (R, 1)), jnp.ones((R, 4, 2)))
        )
    }
    out = jax.vmap(lambda t: tx.update(t, tx.init(t))[0], axis_name="i")(tree)
    assert not isinstance(out["e"], jaxsync.RowSparse)
    bitwise(out["e"][0], np.ones((4, 2), np.float32), "auto dense")


def test_out_of_range_dropped_and_flagged():
    idx = jnp.array([[0, V, -1]] * R, jnp.int32)  # two out-of-range indices
    vals = jnp.ones((R, 3, D))
    tree = {"e": _sparse.RowSparse.tree_unflatten(V, (idx, vals))}
    tx = jaxsync.hierarchical_mean(axis_name="i", comm=None, check_finite=True)
    out, state = jax.vmap(lambda t: tx.update(t, tx.init(t)), axis_name="i")(tree)
    assert not bool(state.all_finite.any())
    dense = np.asarray(
        _sparse.RowSparse.tree_unflatten(V, (out["e"].indices[0], out["e"].values[0])).todense()
    )
    want = np.zeros((V, D), np.float32)
    want[0] = 1.0
    bitwise(dense, want, "out-of-range rows dropped")
    # In range: the flag stays true.
    ok_tree = {"e": _sparse.RowSparse.tree_unflatten(V, (idx % V, vals))}
    _, state = jax.vmap(lambda t: tx.update(t, tx.init(t)), axis_name="i")(ok_tree)
    assert bool(state.all_finite.all())
    # Synced dense (mode="dense"): the flag is raised too, on every replica.
    txd = jaxsync.hierarchical_mean(
        axis_name="i", comm=None, check_finite=True, sparse=jaxsync.SparseOptions(mode="dense")
    )
    one_bad = idx.at[1:].set(idx[1:] % V)  # only replica 0 has bad indices
    _, state = jax.vmap(lambda t: txd.update(t, txd.init(t)), axis_name="i")(
        {"e": _sparse.RowSparse.tree_unflatten(V, (one_bad, vals))}
    )
    assert not bool(state.all_finite.any())
    _, state = jax.vmap(lambda t: txd.update(t, txd.init(t)), axis_name="i")(ok_tree)
    assert bool(state.all_finite.all())
    # coalesce turns invalid indices into padding (index V, zero values).
    c = jaxsync.RowSparse(jnp.array([3, -2, 3, V + 5]), jnp.ones((4, 1)), V).coalesce()
    bitwise(c.indices, np.array([3, V, V, V], np.int32), "coalesced indices")
    bitwise(c.values[:, 0], np.array([2, 0, 0, 0], np.float32), "coalesced values")


def test_agreement_text_names_k_and_num_rows():
    """The text every process compares holds k and num_rows of each sparse leaf."""
    seen = []

    class Recorder(jaxsync._comm._axis_backend.LocalBackend):
        def agree(self, text, what, bufs):
            seen.append(text)
            return bufs

    cfg = jaxsync._core._config.make_config("t", "hierarchical", "i", None)
    import dataclasses

    cfg = dataclasses.replace(cfg, backend=Recorder())
    tree = stacked_tree()
    jax.vmap(lambda t: jaxsync._core._sync.sync(t, cfg)[0], axis_name="i")(tree)
    assert f"row-sparse leaf emb: k {K} num_rows {V} row_shape ({D},)" in seen[0]
    assert "-> sparse" in seen[0]


def test_densify_then_adam_matches_dense():
    params = {"emb": jnp.arange(V * D, dtype=jnp.float32).reshape(V, D), "w": jnp.ones(4)}
    g_sparse = {"emb": jaxsync.RowSparse(*map(jnp.asarray, rows(1)), V), "w": jnp.ones(4)}
    g_dense = {"emb": jnp.asarray(dense_of(*rows(1)).astype(np.float32)), "w": jnp.ones(4)}
    a = optax.chain(jaxsync.densify(), optax.adam(0.1))
    b = optax.adam(0.1)
    with jax.numpy_dtype_promotion("standard"):  # optax.adam's bias correction
        ua, _ = a.update(g_sparse, a.init(params), params)
        ub, _ = b.update(g_dense, b.init(params), params)
    for k in params:
        bitwise(ua[k], ub[k], k)


def test_sparse_sgd_and_adagrad_against_dense():
    params = {"emb": jnp.arange(V * D, dtype=jnp.float32).reshape(V, D) / 8, "w": jnp.ones(4)}
    idx, vals = rows(2)
    g_sparse = {
        "emb": jaxsync.RowSparse(jnp.asarray(idx), jnp.asarray(vals), V),
        "w": jnp.full(4, 2.0),
    }
    g_dense = {"emb": jnp.asarray(dense_of(idx, vals).astype(np.float32)), "w": jnp.full(4, 2.0)}
    # SGD: lr a power of two, integer gradients: exact.
    tx = jaxsync.sparse_sgd(0.5)
    u, _ = tx.update(g_sparse, tx.init(params))
    got = jaxsync.apply_sparse_updates(params, u)
    sgd = optax.sgd(0.5)
    want = optax.apply_updates(params, sgd.update(g_dense, sgd.init(params))[0])
    for k in params:
        bitwise(got[k], want[k], f"sgd {k}")
    # Adagrad: two steps against optax.adagrad (same rule on every row: rows
    # not touched have a zero gradient, so optax leaves them unchanged too).
    ta = jaxsync.sparse_adagrad(0.1, initial_accumulator_value=0.1, eps=1e-7)
    tb = optax.adagrad(0.1, initial_accumulator_value=0.1, eps=1e-7)
    pa, pb, sa, sb = params, params, ta.init(params), tb.init(params)
    for _ in range(2):
        ua, sa = ta.update(g_sparse, sa, pa)
        pa = jaxsync.apply_sparse_updates(pa, ua)
        ub, sb = tb.update(g_dense, sb, pb)
        pb = optax.apply_updates(pb, ub)
    for k in params:
        np.testing.assert_allclose(
            np.asarray(pa[k]), np.asarray(pb[k]), rtol=1e-6, atol=0, err_msg=f"adagrad {k}"
        )


def test_row_sparse_grad_plain_and_array_ids():
    rng = np.random.default_rng(0)
    params = {
        "emb": jnp.asarray(rng.normal(size=(50, 4)), jnp.float32),
        "dense": {"w": jnp.asarray(rng.normal(size=(4, 2)), jnp.float32)},
    }
    batch = {"ids": jnp.array([[3, 7, 3], [49, 0, 7]]), "y": jnp.array([0, 1])}

    def loss_fn(p, b):
        h = p["emb"][b["ids"]].mean(1)
        logits = h @ p["dense"]["w"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    ref = jax.grad(loss_fn)(params, batch)
    for tables in ({"emb": "ids"}, {"emb": batch["ids"]}):
        g = (
            jax.jit(lambda p, b, t=tables: jaxsync.row_sparse_grad(loss_fn, p, b, tables=t))(
                params, batch
            )
            if isinstance(tables["emb"], str)
            else jaxsync.row_sparse_grad(loss_fn, params, batch, tables=tables)
        )
        assert isinstance(g["emb"], jaxsync.RowSparse) and g["emb"].k == 6
        np.testing.assert_allclose(g["emb"].todense(), ref["emb"], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(g["dense"]["w"], ref["dense"]["w"], rtol=1e-6)
    v, g = jaxsync.row_sparse_grad(loss_fn, params, batch, tables={"emb": "ids"}, return_value=True)
    np.testing.assert_allclose(v, loss_fn(params, batch), rtol=1e-6)
    # has_aux: the aux comes back beside the gradient (the ids seen are positions
    # in the compact table, 0..5).
    g, aux = jaxsync.row_sparse_grad(
        lambda p, b: (loss_fn(p, b), b["ids"].max()),
        params,
        batch,
        tables={"emb": "ids"},
        has_aux=True,
    )
    assert int(aux) <= 5 and isinstance(g["emb"], jaxsync.RowSparse)


def test_row_sparse_grad_flax():
    nn = pytest.importorskip("flax.linen")

    class Bag(nn.Module):
        @nn.compact
        def __call__(self, ids):
            return nn.Dense(3)(nn.Embed(40, 4)(ids).mean(1))

    model = Bag()
    ids = jnp.array([[1, 2, 2], [39, 0, 1]])
    params = model.init(jax.random.key(0), ids)
    y = jnp.array([0, 2])

    def loss_fn(p, b):
        return optax.softmax_cross_entropy_with_integer_labels(
            model.apply(p, b["ids"]), b["y"]
        ).mean()

    batch = {"ids": ids, "y": y}
    ref = jax.grad(loss_fn)(params, batch)
    # nn.Embed checks its table's shape: pass the ids as an array.
    g = jaxsync.row_sparse_grad(loss_fn, params, batch, tables={"params/Embed_0/embedding": ids})
    emb = g["params"]["Embed_0"]["embedding"]
    assert isinstance(emb, jaxsync.RowSparse) and emb.num_rows == 40
    bitwise(emb.todense(), ref["params"]["Embed_0"]["embedding"], "flax embedding")


def test_validation_errors():
    with pytest.raises(TypeError, match="num_rows"):
        jaxsync.RowSparse(jnp.zeros(2, jnp.int32), jnp.zeros((2, 1)), 0)
    with pytest.raises(TypeError, match="indices"):
        jaxsync.RowSparse(jnp.zeros(2), jnp.zeros((2, 1)), 3)
    with pytest.raises(ValueError, match="values must have shape"):
        jaxsync.RowSparse(jnp.zeros(2, jnp.int32), jnp.zeros((3, 1)), 3)
    with pytest.raises(ValueError, match="mode must be one of"):
        jaxsync.SparseOptions(mode="sometimes")
    with pytest.raises(TypeError, match="'sparse'"):
        jaxsync.hierarchical_mean(axis_name="i", comm=None, sparse={"mode": "dense"})
    with pytest.raises(ValueError, match="learning_rate"):
        jaxsync.sparse_sgd(-1.0)
    with pytest.raises(KeyError, match="no leaf 'nope'"):
        jaxsync.row_sparse_grad(
            lambda p, b: 0.0,
            {"e": jnp.zeros((2, 1))},
            {"ids": jnp.zeros(1, jnp.int32)},
            tables={"nope": "ids"},
        )


def test_check_finite_raise_names_sparse_leaf():
    tx = jaxsync.hierarchical_mean(axis_name="i", comm=None, check_finite="raise")
    f = jax.jit(jax.vmap(lambda t: tx.update(t, tx.init(t))[0], axis_name="i"))
    idx = jnp.tile(jnp.array([0, 1, 2], jnp.int32), (R, 1))
    good = {
        "e": _sparse.RowSparse.tree_unflatten(V, (idx, jnp.ones((R, 3, D)))),
        "w": jnp.ones((R, 2)),
    }
    jax.block_until_ready(f(good))  # no error
    bad = {
        "e": _sparse.RowSparse.tree_unflatten(V, (idx.at[5, 1].set(V + 3), jnp.ones((R, 3, D)))),
        "w": jnp.ones((R, 2)),
    }
    error = raises_then_clean(lambda: f(bad), lambda: f(good))
    assert "indices outside [0, num_rows)" in str(error)
    assert "row-sparse leaves e" in str(error)


def test_integer_rows_with_mean_are_refused_sum_is_exact():
    """The mean of integer rows is not an integer: refused at trace time, naming
    the leaf, the dtype and the fix; reduce="sum" gathers them exactly (in every
    mode: the dense path would pass an integer leaf through unreduced)."""
    g = _sparse.RowSparse.tree_unflatten(
        3, (jnp.zeros((2, 1), jnp.int32), jnp.full((2, 1), 6, jnp.int32))
    )  # 2 replicas, each 6 in row 0: the sum is [12, 0, 0], the mean would be 6

    def run(reduce, mode="auto"):
        tx = jaxsync.hierarchical_mean(
            axis_name="i", comm=None, reduce=reduce, sparse=jaxsync.SparseOptions(mode=mode)
        )
        return jax.vmap(
            lambda t: jaxsync.densify().update(tx.update(t, tx.init(t))[0], None)[0],
            axis_name="i",
        )({"e": g})["e"]

    for mode in ("auto", "dense", "sparse"):
        with pytest.raises(
            TypeError, match="reduce='mean' got the row-sparse leaf 'e' with int32"
        ) as e:
            run("mean", mode)
        assert "Fix:" in str(e.value) and "reduce='sum'" in str(e.value)
        got = run("sum", mode)
        assert got.dtype == jnp.int32, mode
        np.testing.assert_array_equal(np.asarray(got), np.array([[12, 0, 0]] * 2), err_msg=mode)

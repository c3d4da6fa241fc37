"""jaxsync.sharded with comm_dtype=jaxsync.Quantized(...): the reduce-scatter
quantized (one process; the processes a mesh axis through jaxsync.AxisComm).

Each replica's rows (its process's float32 sum of the slices it owns across the
processes) are quantized in blocks, all-to-all'd, and summed in float32 by the
slice's owner; nothing is requantized (the updates are gathered in their own
dtype). Checked against a float64 reference with the first quantization's
bound only, per block of each row: leaves of size 0, 1 and not a multiple of
the block, a bfloat16 leaf, all-zero blocks, NaN/inf (NaN exactly on their
blocks; check_finite sees them), 1 to 4 processes, under vmap and
jit(shard_map). Error feedback: the residual is the rows' quantization error
bit for bit, and a second step sends it (the two steps' sum errs by the
residual's quantization only).
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
from jaxsync._core._quant import _grid, decode, encode
from jaxsync.zero._layout import make_layout

SIZES = [13, 0, 1, 40, 6]  # leaf 4 is bfloat16


def _tree(H, L, seed, special):
    rng = np.random.default_rng(seed)
    leaves = [
        (rng.standard_normal((H, L, n)) * 10.0 ** (k % 3 - 1)).astype(np.float32)
        for k, n in enumerate(SIZES)
    ]
    leaves[3][:, :, 8:16] = 0  # an all-zero block (block 8) in every replica
    if special != "none":
        leaves[3][H - 1, L - 1, 29] = np.nan if special == "nan" else np.inf
    tree = [jnp.asarray(x) for x in leaves]
    tree[4] = tree[4].astype(jnp.bfloat16)
    return tree


def _rows(leaves, layout, R):
    """Per dtype group, every replica's ``(R, K)`` rows (float64)."""
    out = []
    for idx in layout.groups().values():
        cols = []
        for i in idx:
            s = layout.slots[i]
            flat = np.asarray(leaves[i], np.float64).reshape(R, -1)
            cols.append(np.pad(flat, ((0, 0), (0, R * s.k - s.n))).reshape(R, R, s.k))
        out.append((idx, np.concatenate(cols, axis=2)))  # (replica, slice, K)
    return out


def _blockmax(v, B):
    """``v`` (..., K): each value's block maximum along the last axis."""
    K = v.shape[-1]
    pad = np.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, -K % B)])
    m = pad.reshape(*v.shape[:-1], -1, B).max(axis=-1)
    return np.repeat(m, B, axis=-1)[..., :K]


def _reference(tree, H, L, spec):
    """Per leaf: the exact mean, its bound, where it must be NaN (float64)."""
    R = H * L
    layout = make_layout([x[0, 0] for x in tree], L, H)  # bfloat16 its own group
    leaves = [np.asarray(x, np.float32) for x in tree]
    pre = float(R) if R & (R - 1) == 0 else 1.0
    post = R / pre
    gap = 1.0 if spec.kind == "int" else float(np.diff(_grid(spec)).max())
    half = gap / 2 / spec.qmax * (2 if spec.rounding == "stochastic" else 1)
    means, bounds, dirty = {}, {}, {}
    for idx, rows in _rows([x.reshape(R, -1) for x in leaves], layout, R):
        fin = np.where(np.isfinite(rows), rows, 0.0)
        x = fin.reshape(H, L, R, -1).sum(axis=1) / pre  # (host, slice, K)
        e1 = 0.0 if H == 1 else (_blockmax(np.abs(x), spec.block) * half).sum(axis=0)
        slack = (_blockmax(np.abs(fin).sum(axis=0) / pre, spec.block) + e1) * 2.0**-18
        bound = (e1 + slack) / post + 1e-30
        bad = _blockmax((~np.isfinite(rows)).any(axis=0).astype(float), spec.block) > 0
        if H == 1:
            bad = (~np.isfinite(rows)).any(axis=0)
        mean = fin.sum(axis=0) / R
        a = 0
        for i in idx:
            s = layout.slots[i]
            cut = lambda v: v[:, a : a + s.k].reshape(-1)[: s.n]
            means[i], bounds[i], dirty[i] = cut(mean), cut(bound), cut(bad)
            a += s.k
    return (
        [means[i] for i in range(len(leaves))],
        [bounds[i] for i in range(len(leaves))],
        [dirty[i] for i in range(len(leaves))],
    )


def _tx(spec):
    return jaxsync.sharded(
        optax.sgd(1.0),
        axis_name="local",
        comm=jaxsync.AxisComm("host"),
        comm_dtype=spec,
        check_finite=True,
    )


def _body(tx, steps=1):
    def body(*leaves):
        g = list(leaves)
        st = tx.init(g)
        outs, res = [], []
        for k in range(steps):
            u, st = tx.update(g if k == 0 else [jnp.zeros_like(x) for x in g], st, g)
            outs.append(u)
            res.append(st.residual)
        return outs, res, st.all_finite

    return body


def _run(mode, tx, tree, H, L, steps=1):
    body = _body(tx, steps)
    if mode == "vmap":
        return jax.jit(jax.vmap(jax.vmap(body, axis_name="local"), axis_name="host"))(*tree)
    mesh = Mesh(np.array(jax.devices()[: H * L]).reshape(H, L), ("host", "local"))
    spec = P(("host", "local"))

    def per_device(*leaves):
        outs, res, ok = body(*[x[0] for x in leaves])
        return (
            jax.tree.map(lambda y: y[None], outs),
            jax.tree.map(lambda y: y[None], res),
            ok[None],
        )

    flat = [x.reshape(H * L, *x.shape[2:]) for x in tree]
    outs, res, ok = jax.jit(
        jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=(spec, spec, spec))
    )(*flat)
    back = lambda y: y.reshape(H, L, *y.shape[1:])
    return jax.tree.map(back, outs), jax.tree.map(back, res), back(ok)


CASES = [
    ("vmap", (2, 2), (8, "int", "nearest"), "none"),
    ("vmap", (4, 1), (8, "float", "stochastic"), "nan"),
    ("vmap", (3, 2), (4, "int", "nearest"), "inf"),
    ("vmap", (1, 2), (4, "float", "nearest"), "none"),
    ("shard_map", (2, 4), (4, "float", "stochastic"), "none"),
]


@pytest.mark.parametrize("mode, shape, fmt, special", CASES)
def test_sharded_quantized_mean_within_bound(mode, shape, fmt, special):
    H, L = shape
    bits, kind, rounding = fmt
    spec = jaxsync.Quantized(bits=bits, kind=kind, block=8, rounding=rounding)
    tree = _tree(H, L, seed=H * 10 + L, special=special)
    (u,), _, ok = _run(mode, _tx(spec), tree, H, L)
    means, bounds, dirty = _reference(tree, H, L, spec)
    for i, y in enumerate(u):
        y = np.asarray(y, np.float32).reshape(H * L, -1)
        assert (y.view(np.uint32) == y[:1].view(np.uint32)).all()  # every replica the same
        got = -y[0].astype(np.float64)  # sgd(1.0): the update is minus the mean
        if i == 4:  # bfloat16: its own rounding on top
            bounds[i] = bounds[i] + np.abs(means[i]) * 2.0**-8
        assert (np.isnan(got) == dirty[i]).all(), (i, np.flatnonzero(np.isnan(got)))
        ok_ = ~dirty[i]
        err = np.abs(got[ok_] - means[i][ok_])
        assert (err <= bounds[i][ok_]).all(), (i, (err - bounds[i][ok_]).max())
        if i == 3 and H > 1:  # the all-zero block: exact zeros
            assert (got[8:16] == 0).all()
    assert (np.asarray(ok) == (special == "none")).all()


def test_error_feedback_residual_is_the_rows_error_and_is_sent():
    H, L = 2, 2
    spec = jaxsync.Quantized(bits=4, kind="int", block=8)
    tree = _tree(H, L, seed=5, special="none")[:4]  # float32 leaves: one buffer
    (u1, u2), ((res,), (res2,)), _ = _run("vmap", _tx(spec), tree, H, L, steps=2)
    R = H * L
    layout = make_layout([x[0, 0] for x in tree], L, H)
    [(_, rows)] = _rows([np.asarray(x).reshape(R, -1) for x in tree], layout, R)
    rows = rows.astype(np.float32) / np.float32(R)  # predivided (R = 4)
    x = rows.reshape(H, L, R, -1)
    for h in range(H):
        for d in range(L):
            mine = (x[h, 0] + x[h, 1])[d::L]  # this replica's rows: slices p * L + d
            K = mine.shape[1]
            even = np.pad(mine, ((0, 0), (0, K % 2)))  # 4 bits: rows of an even length
            codes, scales = encode(jnp.asarray(even), spec)
            back = np.asarray(decode(codes, scales, even.shape[1], spec))[:, :K]
            want = (mine - back).reshape(-1)
            # the error of the rows' quantization (XLA may fuse the decode's
            # product into the subtraction: one rounding of float32 apart)
            got = np.asarray(res[h, d], np.float64)
            assert (np.abs(got - want) <= np.abs(mine).reshape(-1) * 2.0**-23).all()
            assert np.abs(got).max() > 0
    # step 2 (zero gradients) sends the residuals: the two steps' sum errs by
    # their quantization only
    means, _, _ = _reference(tree, H, L, spec)
    assert np.abs(np.asarray(res2)).max() < np.abs(np.asarray(res)).max() / 4
    r = np.asarray(res, np.float64).reshape(H, L, H, -1)  # (host, device, row p, K)
    e2 = (_blockmax(np.abs(r), spec.block) * (0.5 / spec.qmax)).sum(axis=0)  # (L, H, K)
    e2 = e2.transpose(1, 0, 2).reshape(R, -1).max() + 1e-6
    for i in (0, 2, 3):  # (leaf 1 is empty)
        both = -(np.asarray(u1[i], np.float64) + np.asarray(u2[i], np.float64))[0, 0]
        assert np.abs(both - means[i]).max() <= e2, i


def test_state_specs_and_a_wrong_state():
    spec = jaxsync.Quantized(bits=8, block=8)
    tx = _tx(spec)
    shapes = jax.eval_shape(tx.init, [jnp.ones(13)])
    specs = jaxsync.state_specs(shapes, "local")
    assert specs.residual == (P("local"),) and specs.step == P()
    off = jaxsync.sharded(
        optax.sgd(1.0), axis_name=None, comm=None, comm_dtype=_no_feedback(spec)
    ).init([jnp.ones(13)])
    assert off.residual is None and off.step.shape == ()

    def bad(x):
        st = tx.init([x])
        st = st.__class__(st.inner, st.all_finite, st.per_replica, (jnp.zeros(3),), st.step)
        return tx.update([x], st)

    with pytest.raises(ValueError, match=r"residuals have shapes \[\(3,\)\].*Fix"):
        jax.vmap(jax.vmap(bad, axis_name="local"), axis_name="host")(jnp.ones((2, 2, 13)))

    def restored(x):  # as shard_state makes it: no residuals, no step
        st = tx.init([x])
        st = st.__class__(st.inner, st.all_finite, st.per_replica)
        return tx.update([x], st)[1]

    st = jax.vmap(jax.vmap(restored, axis_name="local"), axis_name="host")(jnp.ones((2, 2, 13)))
    assert st.residual[0].shape == (2, 2, 8) and (np.asarray(st.step) == 1).all()


def _no_feedback(spec):
    import dataclasses

    return dataclasses.replace(spec, error_feedback=False)

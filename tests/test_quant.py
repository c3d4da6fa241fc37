"""The block-quantized formats' codec (jaxsync.Quantized, _core._quant): exact checks.

Values a format represents exactly (integer codes times a power-of-two scale)
round-trip bit for bit; random values stay within the stated bound per block
against a float64 reference; all-zero blocks give scale 0 and exact zeros; a
non-finite value makes its block (only) NaN; leaves of size 0, 1 and not a
multiple of the block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsync
from jaxsync._core._quant import Quantized, decode, encode, half_step
from jaxsync._core._quant import roundtrip as _roundtrip

roundtrip = jax.jit(_roundtrip, static_argnums=1)  # one compile per case, not per op

FORMATS = [(8, "int"), (8, "float"), (4, "int"), (4, "float")]
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _u32(a):
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize(
    "kw, arg",
    [
        (dict(bits=6), "bits"),
        (dict(bits=True), "bits"),
        (dict(kind="fp"), "kind"),
        (dict(block=3), "block"),
        (dict(block=0), "block"),
        (dict(block=2.0), "block"),
        (dict(rounding="up"), "rounding"),
        (dict(error_feedback=1), "error_feedback"),
    ],
)
def test_spec_validated(kw, arg):
    with pytest.raises(ValueError, match=rf"Quantized: {arg} must be .*got .*Fix: pass"):
        jaxsync.Quantized(**kw)


def test_wire_bytes_formula():
    # n (b/8 + 4/B) bytes for whole blocks; partial blocks count a scale each
    for bits in (8, 4):
        q = Quantized(bits=bits, block=2048)
        assert q.wire_bytes(4 * 2048) == 4 * 2048 * bits // 8 + 4 * 4
        assert q.wire_bytes(2049) == -(-2049 * bits // 8) + 8
        assert q.wire_bytes(0) == 0


def _grid(bits, kind):
    """The format's non-negative values, from its definition."""
    if kind == "int":
        return np.arange(0, (127 if bits == 8 else 7) + 1, dtype=np.float32)
    if bits == 8:
        return np.arange(127, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32)
    return np.array(E2M1, np.float32)


def _representable(bits, kind, rng, block):
    """Exactly representable values: a grid value per element, times 2**-3,
    each block holding +-qmax (so its scale is exactly 2**-3)."""
    grid = _grid(bits, kind)
    x = rng.choice(grid, size=5 * block) * rng.choice([-1.0, 1.0], size=5 * block)
    x[::block] = grid[-1]
    return (x * np.float32(0.125)).astype(np.float32)


@pytest.mark.parametrize("bits, kind", FORMATS)
def test_representable_values_round_trip_bitwise(bits, kind):
    rng = np.random.default_rng(bits)
    q = Quantized(bits=bits, kind=kind, block=64)
    x = _representable(bits, kind, rng, 64)
    y = np.asarray(roundtrip(jnp.asarray(x), q))
    assert (_u32(y) == _u32(x + 0.0)).all()  # +0.0: a -0 input comes back as +0


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("bits, kind", FORMATS)
def test_error_within_bound(bits, kind, rounding):
    for n in (300,) if (bits, kind) != (8, "int") else (0, 1, 65, 300):
        _check_bound(bits, kind, rounding, n)


def _check_bound(bits, kind, rounding, n):
    rng = np.random.default_rng(n)
    q = Quantized(bits=bits, kind=kind, block=64, rounding=rounding)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, n)).astype(np.float32)
    x[64:128] = 0.0  # an all-zero block (when n > 64)
    y = np.asarray(roundtrip(jnp.asarray(x), q, jax.random.PRNGKey(7)), np.float64)
    bound = half_step(x, q) * (1 if rounding == "nearest" else 2)
    # float32 computes the scale and x / scale: a few ulp of the scale on top
    slack = 1 + 2.0**-18
    assert y.shape == (n,)
    assert (np.abs(y - x.astype(np.float64)) <= bound * slack).all()
    assert (y[64:128] == 0).all()


@pytest.mark.parametrize("bits, kind", FORMATS)
def test_stochastic_picks_a_neighbour_and_repeats(bits, kind):
    q = Quantized(bits=bits, kind=kind, block=8, rounding="stochastic")
    qmax = q.qmax
    # scale exactly 1: y = x; neighbours are the grid values around each x
    x = jnp.array([qmax, 0.3, -0.3, 1.2, -2.6, 0.0, 5.5 if qmax > 6 else 5.0, 0.0], jnp.float32)
    outs = [np.asarray(roundtrip(x, q, jax.random.PRNGKey(k))) for k in range(20)]
    grid = _grid(bits, kind)
    xs = np.asarray(x)
    for y in outs:
        lo = np.array([grid[grid <= abs(v)].max() for v in xs]) * np.sign(xs)
        hi = np.array([grid[grid >= abs(v)].min() for v in xs]) * np.sign(xs)
        assert ((y == lo) | (y == hi)).all(), (y, lo, hi)
    again = np.asarray(roundtrip(x, q, jax.random.PRNGKey(3)))
    assert (_u32(again) == _u32(outs[3])).all()
    assert len({tuple(o) for o in outs}) > 1  # the key matters


@pytest.mark.parametrize("bits, kind", FORMATS)
def test_nonfinite_block_is_nan_others_intact(bits, kind):
    q = Quantized(bits=bits, kind=kind, block=4)
    x = jnp.array([1.0, jnp.inf, 2.0, 3.0, 0.5, 1.0, 0.0, -2.0, jnp.nan, 1, 1, 1], jnp.float32)
    y = np.asarray(roundtrip(x, q))
    assert np.isnan(y[:4]).all() and np.isnan(y[8:]).all()
    assert np.isfinite(y[4:8]).all()


def test_encode_shapes_and_zero_scale():
    q = Quantized(bits=4, kind="int", block=4)
    codes, scales = encode(jnp.zeros((3, 6)), q)
    assert codes.shape == (3, 3) and codes.dtype == jnp.uint8
    assert scales.shape == (3, 2) and (np.asarray(scales) == 0).all()
    back = np.asarray(decode(codes, scales, 6, q))
    assert (_u32(back) == 0).all()
    with pytest.raises(ValueError, match="even length"):
        encode(jnp.zeros((1, 3)), q)


@pytest.mark.parametrize("bits", [8, 4])
def test_float_neighbours_match_a_grid_search(bits):
    # stochastic rounding's neighbours come from elementwise arithmetic, not a
    # search of the grid: the same codes as numpy's searchsorted, for every grid
    # value, midpoint, its neighbouring floats, values above qmax and NaN
    from jaxsync._core._quant import _codes

    q = Quantized(bits=bits, kind="float", rounding="stochastic")
    g = _grid(bits, "float").astype(np.float32)
    mids = ((g[1:] + g[:-1]) / 2).astype(np.float32)
    a = np.concatenate(
        [g, mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf), np.nextafter(g, np.inf)]
    )
    a = np.concatenate([a, [q.qmax * 1.0000001, np.inf, np.nan]]).astype(np.float32)
    rng = np.random.default_rng(bits)
    a = np.concatenate([a, rng.uniform(0, q.qmax, 4000).astype(np.float32)])
    u = rng.uniform(0, 1, a.shape).astype(np.float32)
    got = np.asarray(jax.jit(lambda a, u: _codes(a, q, u))(jnp.asarray(a), jnp.asarray(u)))
    top = len(g) - 1
    lo = np.clip(np.searchsorted(g, a, side="right") - 1, 0, top)  # NaN sorts last
    hi = np.minimum(lo + 1, top)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.where(g[hi] > g[lo], (a - g[lo]) / (g[hi] - g[lo]), 0).astype(np.float32)
    assert (got == lo + (u < p)).all()


def test_stochastic_noise_is_uniform_and_unbiased():
    from jaxsync._core._quant import uniform

    u = np.asarray(uniform(jax.random.PRNGKey(0), (4, 2**14)), np.float64)
    assert (u >= 0).all() and (u < 1).all()
    # 2^16 draws: each of 16 bins within 6 standard deviations of 4096
    counts = np.bincount((u * 16).astype(int).ravel(), minlength=16)
    assert (np.abs(counts - 4096) < 6 * np.sqrt(4096)).all(), counts
    assert np.array_equal(u, np.asarray(uniform(jax.random.PRNGKey(0), (4, 2**14))))
    assert not np.array_equal(u, np.asarray(uniform(jax.random.PRNGKey(1), (4, 2**14))))
    # unbiased rounding: the mean of 2^16 roundings of 0.3 (scale 1) is 0.3
    # within 6 standard deviations
    for bits, kind in FORMATS:
        q = Quantized(bits=bits, kind=kind, block=2**16, rounding="stochastic")
        x = jnp.full((2**16,), 0.3, jnp.float32).at[0].set(q.qmax)
        y = np.asarray(roundtrip(x, q, jax.random.PRNGKey(2)), np.float64)[1:]
        grid = _grid(bits, kind).astype(np.float32)
        lo, hi = grid[grid <= 0.3].max(), grid[grid >= 0.3].min()  # 0.3's neighbours
        p = (0.3 - lo) / (hi - lo)
        sd = (hi - lo) * np.sqrt(p * (1 - p) / y.size)
        assert set(np.unique(y)) <= {np.float32(lo), np.float32(hi)}, np.unique(y)
        assert abs(y.mean() - 0.3) < 6 * sd, (q, y.mean())


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("bits, kind", FORMATS)
def test_tiny_blocks_quantize_as_their_scaled_copy(bits, kind, rounding):
    """A block whose largest value is below ``2**-100`` (here down to ``2**-124``,
    where ``amax / qmax`` is below float32's normal range and XLA flushed the
    scale to 0: the block decoded to zeros, up to 6x (e2m1) to 254x (int8)
    the bound) has the codes of the same block times ``2**64`` and decodes to its
    values times ``2**-64``, bit for bit, so within the same bound."""
    q = Quantized(bits=bits, kind=kind, block=8, rounding=rounding)
    rng = np.random.default_rng(bits + len(kind))
    key = jax.random.PRNGKey(3)
    for e in (-60, -50, -37, -36):  # x 2**-64: 2**-124 .. 2**-100 (the boundary)
        mag = rng.uniform(0.5, 1.0, 32) * np.where(rng.random(32) < 0.5, -1, 1)
        big = (mag * 2.0**e).astype(np.float32)
        big[8:16] = 0.0  # an all-zero block: scale 0 as before
        big[20] = 0.0
        tiny = big * np.float32(2.0**-64)  # exact: a power of two, normal floats
        cb, sb = encode(jnp.asarray(big)[None], q, key)
        ct, st = encode(jnp.asarray(tiny)[None], q, key)
        np.testing.assert_array_equal(np.asarray(ct), np.asarray(cb), err_msg=str(e))
        yb = np.asarray(decode(cb, sb, 32, q))[0]
        yt = np.asarray(decode(ct, st, 32, q))[0]
        np.testing.assert_array_equal(bits_of(yt), bits_of(yb * np.float32(2.0**-64)))
        bound = half_step(tiny, q) * (1 if rounding == "nearest" else 2) * (1 + 2.0**-18)
        err = np.abs(yt.astype(np.float64) - tiny.astype(np.float64))
        assert (err <= bound).all(), (e, float((err / np.maximum(bound, 1e-300)).max()))
        assert (yt[8:16] == 0).all() and np.asarray(st)[0, 1] == 0


def bits_of(a):
    return np.asarray(a, np.float32).view(np.uint32)

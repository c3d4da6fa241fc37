"""The quantized mean's float64 reference and error bound, and the examples the
property tests draw (shared by test_quant_sync.py and mpi/worker_quant.py, so
every rank of an MPI run draws the same examples: hypothesis is derandomized).

The bound, per element of a bucket (``H`` processes, each ``x_h`` = its float32
sum of its ``L`` replicas, predivided by ``pre``), in the layout the schedule
quantizes (each peer's slice of ``m`` values cut into blocks of ``B``):
``E1 = sum_h a_h / qmax * g / 2`` (the first quantization: ``a_h`` the block's
``max |x_h|``, ``g`` the format's largest gap, 1 for ints), then the summed
block quantized again, ``E2 = (max |sum_h x_h| + E1) / qmax * g / 2``; stochastic
rounding doubles both. The mean's error is at most ``(E1 + E2) / post`` plus
float32 rounding. A block holding a non-finite value in any replica is NaN.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

import jaxsync
from jaxsync._core._quant import _grid

SIZES = [0, 1, 3, 7, 8, 13, 24, 40]


@st.composite
def examples(draw, replicas=(1, 8)):
    """A random example: leaf sizes, a format, values' seed, special blocks."""
    sizes = draw(st.lists(st.sampled_from(SIZES), min_size=1, max_size=4))
    bits, kind = draw(st.sampled_from([(8, "int"), (8, "float"), (4, "int"), (4, "float")]))
    spec = jaxsync.Quantized(
        bits=bits,
        kind=kind,
        block=draw(st.sampled_from([4, 8])),
        rounding=draw(st.sampled_from(["nearest", "stochastic"])),
    )
    special = draw(st.sampled_from(["none", "zeros", "nan", "inf"]))
    seed = draw(st.integers(0, 2**31 - 1))
    return sizes, spec, special, seed


def values(sizes, special, seed, replicas):
    """``(replicas, leaf) -> float32 array``: the gradients of every replica."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(replicas):
        leaves = []
        for k, n in enumerate(sizes):
            scale = 10.0 ** ((seed + k) % 5 - 2)
            leaves.append((rng.standard_normal(n) * scale).astype(np.float32))
        out.append(leaves)
    big = [k for k, n in enumerate(sizes) if n >= 8]
    if big and special == "zeros":  # the first 8 values zero in every replica
        for leaves in out:
            leaves[big[0]][:8] = 0
    if big and special in ("nan", "inf"):
        out[replicas - 1][big[-1]][5] = np.nan if special == "nan" else np.inf
    return out


def _fin(v):
    return np.where(np.isfinite(v), v, 0.0)


def _layout(n, segments, H, spec):
    """Per bucket element: (segment, row, block) ids of the quantized layout."""
    seg_len = -(-n // segments)
    ids = []
    for e in range(n):
        s, i = divmod(e, seg_len)
        m = -(-seg_len // H)
        m += m % 2 if spec.bits == 4 else 0
        row, j = divmod(i, m)
        ids.append((s, row, j // spec.block))
    return ids


def _block_max(v, ids):
    keys = {}
    for x, key in zip(v, ids):
        keys[key] = max(keys.get(key, 0.0), x)
    return np.array([keys[k] for k in ids]) if ids else np.zeros(0)


def reference(vals, plan, spec, H, L, two_dimensional=False):
    """``(mean, bound, dirty)`` per leaf (float64): the exact mean, its error
    bound, and where the result must be NaN (a block with a non-finite value)."""
    R = H * L
    pre = float(R) if R & (R - 1) == 0 else 1.0
    post = R / pre
    gap = 1.0 if spec.kind == "int" else float(np.diff(_grid(spec)).max())
    half = gap / 2 / spec.qmax * (2 if spec.rounding == "stochastic" else 1)
    nleaves = len(vals[0])
    means = [np.zeros(0)] * nleaves
    bounds = [np.zeros(0)] * nleaves
    dirty = [np.zeros(0, bool)] * nleaves
    for b in plan.buckets:
        cat = lambda r: np.concatenate([vals[r][i].astype(np.float64) for i in b.leaves])
        per = np.stack([cat(r) for r in range(R)])  # (R, n)
        n = per.shape[1]
        x = per.reshape(H, L, n).sum(axis=1) / pre
        absum = np.abs(per).reshape(H, L, n).sum(axis=1) / pre
        total = per.sum(axis=0) / pre
        ids = _layout(n, L if two_dimensional else 1, H, spec)
        with np.errstate(all="ignore"):
            bad = _block_max((~np.isfinite(per)).any(axis=0).astype(float), ids) > 0
            if H == 1:
                e = np.zeros(n)
                a2 = np.zeros(n)
            else:
                a = np.stack([_block_max(np.abs(_fin(xh)), ids) for xh in x])
                e1 = (a * half).sum(axis=0)
                a2 = _block_max(np.abs(_fin(total)), ids) + e1
                e = e1 + a2 * half
        scale = _block_max(_fin(absum).sum(axis=0), ids) + a2
        bound = (e + scale * 2.0**-18) / post + 1e-30
        for i, off in zip(b.leaves, b.offsets):
            size = vals[0][i].shape[0]
            means[i] = total[off : off + size] / post
            bounds[i] = bound[off : off + size]
            dirty[i] = (bad if H > 1 else ~np.isfinite(total))[off : off + size]
    return means, bounds, dirty


def check(out, vals, plan, spec, H, L, two_dimensional=False):
    """Assert the synchronised leaves ``out`` (replica 0's) obey the reference."""
    means, bounds, dirty = reference(vals, plan, spec, H, L, two_dimensional)
    for k, (y, m, bd, bad) in enumerate(zip(out, means, bounds, dirty)):
        y = np.asarray(y, np.float64)
        assert y.shape == m.shape, (k, y.shape, m.shape)
        if H > 1:
            assert np.isnan(y[bad]).all(), (k, y[bad])
        else:
            assert (~np.isfinite(y[bad])).all(), (k, y[bad])
        err = np.abs(y[~bad] - m[~bad])
        assert (err <= bd[~bad]).all(), (k, spec, H, L, float((err / bd[~bad]).max()))

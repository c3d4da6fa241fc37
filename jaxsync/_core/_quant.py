"""Block-quantized wire formats: the :class:`Quantized` spec and its codec.

``comm_dtype=jaxsync.Quantized(bits=8|4, kind="int"|"float", ...)`` sends 8- or
4-bit codes and one float32 scale per block of ``block`` values wherever bytes
cross the inter-process stage (``_quantsum`` runs the schedule). Formats, all
symmetric (a block's scale is ``max |x| / qmax``):

======  =============  =====  ===========================================
bits    kind           qmax   codes
======  =============  =====  ===========================================
8       ``"int"``      127    int8 in [-127, 127]
8       ``"float"``    448    float8 e4m3fn
4       ``"int"``      7      int4 in [-7, 7], two a byte (low nibble first)
4       ``"float"``    6      fp4 e2m1 (0, .5, 1, 1.5, 2, 3, 4, 6), two a byte
======  =============  =====  ===========================================

:func:`encode` / :func:`decode` work on the rows of a ``(rows, m)`` float32
array: each row is cut into blocks of ``block`` values (the last one may be
shorter), every block gets its scale (0 for an all-zero block, whose values
decode to exact zeros; NaN or inf for a block holding a non-finite value,
whose values all decode to NaN, so a finite check still sees them). A tiny
block (``0 < max |x| < 2**-100``) would have a scale below float32's normal
range, which XLA flushes to zero (the block decoding to zeros): its values and
scale are taken times ``2**64`` (exact) and the scale goes on the wire negated,
its sign bit (free: scales are >= 0) telling :func:`decode` to multiply by
``2**-64`` after decoding. Its codes are those of the same block times
``2**64``, and its decoded values that block's times ``2**-64``, bit for bit,
where they are normal floats (``>= 2**-126``); smaller ones are flushed to 0
(an error below ``2**-126``). The wire keeps its size.

May import: JAX only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

_KINDS = ("int", "float")
# A block whose largest magnitude is below _TINY travels scaled by _BOOST (its
# scale negated on the wire): amax / qmax would be subnormal, flushed to 0.
_TINY = 2.0**-100
_BOOST = 2.0**64
_ROUNDINGS = ("nearest", "stochastic")

# The non-negative values of each float format, in code order (the code of a
# magnitude is its bit pattern without the sign): e4m3fn's 0x00..0x7e, e2m1's 0..7.
# (numpy, not jnp: nothing may start JAX's backend at import, or a later
# jax.distributed.initialize() is refused)
_E4M3 = np.arange(127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def _problem(arg: str, expected: str, got, fix: str) -> ValueError:
    return ValueError(f"Quantized: {arg} must be {expected}, got {got!r}. Fix: {fix}.")


@dataclasses.dataclass(frozen=True)
class Quantized:
    """A block-quantized wire format: pass it as ``comm_dtype``.

    Across processes each buffer travels as ``bits``-bit codes and one float32
    scale per ``block`` values: quantized, all-to-all'd (the reduce-scatter),
    decoded and summed in float32, quantized again, all-gathered. Inside a
    process the sum stays float32. See docs/compression.md for the byte counts
    and the error bounds.

    Args:
      bits: 8 or 4.
      kind: ``"int"`` (int8, int4) or ``"float"`` (float8 e4m3fn, fp4 e2m1).
      block: values per float32 scale (>= 2; even).
      rounding: ``"nearest"`` (ties to even) or ``"stochastic"`` (unbiased;
        keys from the step, the bucket and the replica, so a run repeats).
      error_feedback: keep the first quantization's error in the transform's
        state and add it to the next step's buffer (the requantization of the
        summed slices is not covered).

    Example:
      >>> import jaxsync
      >>> q = jaxsync.Quantized(bits=4, kind="float", block=32)
      >>> q.qmax, q.wire_bytes(64)   # 64 values: 32 bytes of codes, 2 scales
      (6.0, 40)
      >>> jaxsync.Quantized(bits=6)
      Traceback (most recent call last):
      ...
      ValueError: Quantized: bits must be 8 or 4, got 6. Fix: pass bits=8 or bits=4.
    """

    bits: int = 8
    kind: str = "int"
    block: int = 2048
    rounding: str = "nearest"
    error_feedback: bool = True

    def __post_init__(self):
        if isinstance(self.bits, bool) or self.bits not in (8, 4):
            raise _problem("bits", "8 or 4", self.bits, "pass bits=8 or bits=4")
        if self.kind not in _KINDS:
            raise _problem("kind", f"one of {_KINDS}", self.kind, "pass kind='int' or kind='float'")
        if (
            isinstance(self.block, bool)
            or not isinstance(self.block, (int, np.integer))
            or self.block < 2
            or self.block % 2
        ):
            raise _problem(
                "block",
                "an even int >= 2 (values per float32 scale)",
                self.block,
                "pass e.g. block=2048",
            )
        if self.rounding not in _ROUNDINGS:
            raise _problem(
                "rounding",
                f"one of {_ROUNDINGS}",
                self.rounding,
                "pass rounding='nearest' (default) or rounding='stochastic'",
            )
        if not isinstance(self.error_feedback, bool):
            raise _problem(
                "error_feedback",
                "a bool",
                self.error_feedback,
                "pass error_feedback=True (default) or False",
            )
        object.__setattr__(self, "block", int(self.block))

    @property
    def name(self) -> str:
        return {
            (8, "int"): "int8",
            (8, "float"): "float8_e4m3fn",
            (4, "int"): "int4",
            (4, "float"): "fp4_e2m1",
        }[(self.bits, self.kind)]

    @property
    def qmax(self) -> float:
        """The largest code's magnitude: a block's scale is ``max |x| / qmax``."""
        return {(8, "int"): 127.0, (8, "float"): 448.0, (4, "int"): 7.0, (4, "float"): 6.0}[
            (self.bits, self.kind)
        ]

    def wire_bytes(self, m: int) -> int:
        """Bytes of ``m`` values on the wire: codes and the blocks' scales."""
        return -(-m * self.bits // 8) + 4 * -(-m // self.block)

    def describe(self) -> str:
        return (
            f"{self.name} block {self.block} {self.rounding} error_feedback {self.error_feedback}"
        )


def _grid(spec: Quantized):
    return _E4M3 if spec.bits == 8 else _E2M1


def _grid_value(code, spec: Quantized):
    """The float format's magnitude of ``code`` (int32, 0..top), exactly."""
    if spec.bits == 8:
        return lax.bitcast_convert_type(code.astype(jnp.uint8), jnp.float8_e4m3fn).astype(
            jnp.float32
        )
    v = jnp.zeros(code.shape, jnp.float32)  # e2m1: selects of its 8 values
    for k, g in enumerate(_E2M1[1:], 1):
        v = jnp.where(code == k, jnp.float32(g), v)
    return v


def _codes(a, spec: Quantized, u):
    """Magnitude codes of ``a`` (>= 0, <= qmax, scaled) as int32; ``u``: None
    (nearest) or uniform [0, 1) noise (stochastic). Elementwise only (no
    lookups): the float grids' neighbours come from the nearest code."""
    if spec.kind == "int":
        q = jnp.floor(a + u) if u is not None else jnp.round(a)
        return jnp.clip(q, 0, spec.qmax).astype(jnp.int32)
    grid = _grid(spec)
    top = len(grid) - 1
    if spec.bits == 8:  # XLA's convert rounds to nearest, ties to even
        f8 = jnp.minimum(a, spec.qmax).astype(jnp.float8_e4m3fn)
        code = lax.bitcast_convert_type(f8, jnp.uint8).astype(jnp.int32)
    elif u is None:  # e2m1: between codes k and k+1 the midpoint goes to the even code
        code = jnp.zeros(a.shape, jnp.int32)
        for k in range(top):
            mid = (grid[k] + grid[k + 1]) / 2
            code = code + (a > mid if k % 2 == 0 else a >= mid).astype(jnp.int32)
    if u is None:
        return code
    # the grid's neighbours around a: lo = the largest code whose value <= a
    # (NaN: the top code, as a search of the grid gives)
    if spec.bits == 8:  # from the nearest code: it or the one below
        near = _grid_value(jnp.minimum(code, top), spec)
        lo = jnp.where(near > a, code - 1, code)
    else:
        lo = jnp.zeros(a.shape, jnp.int32)
        for g in grid[1:]:
            lo = lo + (a >= g).astype(jnp.int32)
    lo = jnp.where(jnp.isnan(a), top, lo)
    hi = jnp.minimum(lo + 1, top)
    glo, ghi = _grid_value(lo, spec), _grid_value(hi, spec)
    p = jnp.where(ghi > glo, (a - glo) / jnp.where(ghi > glo, ghi - glo, 1.0), 0.0)
    return (lo + (u < p).astype(jnp.int32)).astype(jnp.int32)


def _mix(h):
    """A 32-bit integer hash (``lowbias32``: two multiply-xorshift rounds)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


def uniform(key, shape):
    """Uniform [0, 1) float32 noise of ``shape`` for stochastic rounding: a
    counter-based hash of each value's flat index and the key's two words
    (elementwise, so XLA fuses it into the quantization; a threefry draw of
    every value cost about 10 ns each on CPU). 24 random bits a value.

    Example:
      >>> import jax
      >>> from jaxsync._core._quant import uniform
      >>> u = uniform(jax.random.PRNGKey(0), (2, 3))
      >>> bool(((u >= 0) & (u < 1)).all()), u.dtype
      (True, dtype('float32'))
    """
    k = jax.random.bits(key, (2,), jnp.uint32)
    size = int(np.prod(shape))
    i = lax.iota(jnp.uint32, size).reshape(shape)
    h = _mix(_mix(i * jnp.uint32(0x9E3779B9) + k[0]) ^ k[1])
    return (h >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def _blocks(x, block: int):
    """``(rows, m)`` -> ``(rows, nb, block)`` zero-padded, and ``nb``."""
    rows, m = x.shape
    nb = max(-(-m // block), 1) if m else 0
    x = jnp.pad(x, ((0, 0), (0, nb * block - m)))
    return x.reshape(rows, nb, block), nb


def encode(x, spec: Quantized, key=None):
    """Quantize the rows of ``x`` (float32, ``(rows, m)``, ``m`` even for 4 bits).

    Returns ``(codes, scales)``: ``codes`` uint8 of shape ``(rows, m * bits /
    8)``, ``scales`` float32 ``(rows, ceil(m / block))``. ``key``: the
    stochastic rounding's key (``spec.rounding == "stochastic"``).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxsync._core._quant import Quantized, encode, decode
      >>> q = Quantized(bits=8, block=4)
      >>> codes, scales = encode(jnp.array([[1.0, -2.0, 127.0, 0.0]]), q)
      >>> scales, decode(codes, scales, 4, q)
      (Array([[1.]], dtype=float32), Array([[  1.,  -2., 127.,   0.]], dtype=float32))
    """
    x = x.astype(jnp.float32)
    rows, m = x.shape
    if spec.bits == 4 and m % 2:
        raise ValueError(f"encode: 4-bit rows need an even length, got {m}")
    xb, nb = _blocks(x, spec.block)
    amax = jnp.max(jnp.abs(xb), axis=2) if nb else jnp.zeros((rows, 0), jnp.float32)
    tiny = (amax > 0) & (amax < jnp.float32(_TINY))  # its scale would underflow
    boost = jnp.where(tiny, jnp.float32(_BOOST), jnp.float32(1))
    scales = (amax * boost) / jnp.float32(spec.qmax)  # exact: boost is a power of two
    safe = jnp.where(scales == 0, jnp.float32(1), scales)
    y = ((xb * boost[:, :, None]) / safe[:, :, None]).reshape(rows, -1)[:, :m]
    scales = jnp.where(tiny, -scales, scales)  # the sign bit: decode unboosts
    u = None
    if spec.rounding == "stochastic":
        if key is None:
            raise ValueError("encode: stochastic rounding needs a key")
        u = uniform(key, y.shape)
    code = _codes(jnp.abs(y), spec, u)
    neg = jnp.signbit(y) & (code > 0)  # no negative zero codes
    if spec.bits == 8:
        if spec.kind == "int":
            out = lax.bitcast_convert_type(jnp.where(neg, -code, code).astype(jnp.int8), jnp.uint8)
        else:
            out = (code | jnp.where(neg, 0x80, 0)).astype(jnp.uint8)
        return out, scales
    if spec.kind == "int":
        nib = jnp.where(neg, 16 - code, code)  # two's complement in 4 bits
    else:
        nib = code | jnp.where(neg, 0x8, 0)
    nib = nib.astype(jnp.uint8).reshape(rows, -1, 2)
    return (nib[:, :, 0] | (nib[:, :, 1] << 4)).astype(jnp.uint8), scales


def decode(codes, scales, m: int, spec: Quantized):
    """Inverse of :func:`encode`: ``(rows, m)`` float32."""
    rows = codes.shape[0]
    if spec.bits == 8:
        if spec.kind == "int":
            v = lax.bitcast_convert_type(codes, jnp.int8).astype(jnp.float32)
        else:
            v = lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(jnp.float32)
    else:
        nib = jnp.stack([codes & 0xF, codes >> 4], axis=-1).reshape(rows, -1).astype(jnp.int32)
        if spec.kind == "int":
            v = jnp.where(nib >= 8, nib - 16, nib).astype(jnp.float32)
        else:
            table = np.concatenate([_E2M1, -_E2M1])
            v = jnp.asarray(table)[nib]
    nb = scales.shape[1]
    v = jnp.pad(v[:, :m], ((0, 0), (0, nb * spec.block - m))).reshape(rows, nb, spec.block)
    tiny = (scales < 0)[:, :, None]  # a tiny block's boosted scale (NaN is never < 0)
    out = v * jnp.abs(scales)[:, :, None]
    out = jnp.where(tiny, out * jnp.float32(1 / _BOOST), out)
    return out.reshape(rows, -1)[:, :m]


def roundtrip(x, spec: Quantized, key=None):
    """``decode(encode(x))`` of a 1-D float32 array (any length; for tests).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxsync._core._quant import Quantized, roundtrip
      >>> roundtrip(jnp.array([0.0, 3.0, -6.0]), Quantized(bits=4, kind="float"))
      Array([ 0.,  3., -6.], dtype=float32)
    """
    n = x.shape[0]
    xp = jnp.pad(x.astype(jnp.float32), (0, n % 2))[None]
    codes, scales = encode(xp, spec, key)
    return decode(codes, scales, xp.shape[1], spec)[0, :n]


def half_step(x, spec: Quantized):
    """Nearest rounding's bound on ``|x - roundtrip(x)|``, per value: half the
    largest gap of the format's grid at the value's block scale (int: half a
    step; float: half the gap below ``qmax``), in float64. With stochastic
    rounding the bound is the whole gap (twice this)."""
    x = np.asarray(x, np.float64).reshape(-1)
    n = x.shape[0]
    pad = -n % spec.block
    xb = np.pad(np.abs(x), (0, pad)).reshape(-1, spec.block)
    amax = xb.max(axis=1) if xb.size else np.zeros(0)
    gap = 1.0 if spec.kind == "int" else float(np.diff(_grid(spec)).max())
    per = np.repeat(amax / spec.qmax * gap / 2, spec.block)[:n]
    return per

"""The wire formats by name: one registry that the benchmark, the cost model and
``python -m jaxsync info`` read.

A format (``WireFormat``) says what selects it (its ``comm_dtype``: ``None``, a
16-bit dtype's name, or a :class:`Quantized`), what it puts on the wire per value
(``bytes_per_value``), how far one trip through it may move a value
(``error_bound``, float64, nearest rounding) and the trip itself (``roundtrip``:
what a float32 array looks like on the far side). The built-in formats are
registered below; ``register`` adds one (its name unique), ``wire_formats()`` lists
them in order and ``get(name)`` finds one, naming the choices when it does not
exist. A new block format is one entry here with its codec in ``_quant``; a new
16-bit dtype, one entry (``_plan.REDUCED_DTYPES`` permitting).

Imports: numpy, jax and ``_quant`` only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ._quant import Quantized, half_step
from ._quant import roundtrip as _quant_roundtrip


@dataclasses.dataclass(frozen=True)
class WireFormat:
    """One wire format of :func:`jaxsync.wire_formats`.

    Attributes:
      name: its word (the benchmark's ``--wire`` and ``--formats`` choices).
      comm_dtype: what selects it in a factory's ``comm_dtype`` (``None``, a
        16-bit dtype's name, or a :class:`jaxsync.Quantized`).
      summary: one line on what it sends.

    Example:
      >>> import jax.numpy as jnp, numpy as np, jaxsync
      >>> bf16 = [f for f in jaxsync.wire_formats() if f.name == "bfloat16"][0]
      >>> x = np.array([1.0, 1.0 + 2**-9, 3.0])
      >>> err = np.abs(np.asarray(bf16.roundtrip(x), np.float64) - x)
      >>> bool((err <= bf16.error_bound(x)).all()), bf16.bytes_per_value()
      (True, 2.0)
    """

    name: str
    comm_dtype: Any  # None (each buffer's own dtype), "bfloat16"/"float16", or a Quantized
    summary: str

    @property
    def lossless(self) -> bool:
        return self.comm_dtype is None

    def bytes_per_value(self, itemsize: int = 4) -> float:
        """Bytes on the wire per value of a buffer of ``itemsize``-byte values (a
        block format's scales included, spread over its block)."""
        q = self.comm_dtype
        if q is None:
            return float(itemsize)
        if isinstance(q, Quantized):
            return q.bits / 8 + 4 / q.block
        return float(min(itemsize, np.dtype(_np_dtype(q)).itemsize))

    def roundtrip(self, x) -> jnp.ndarray:
        """A 1-D float32 array as the far side of the wire sees it."""
        x = jnp.asarray(x, jnp.float32)
        q = self.comm_dtype
        if q is None:
            return x
        if isinstance(q, Quantized):
            return _quant_roundtrip(x, q)
        return x.astype(q).astype(jnp.float32)

    def error_bound(self, x) -> np.ndarray:
        """Per value of ``x`` (1-D), the bound on ``|x - roundtrip(x)|`` (float64):
        0 lossless; half an ulp of the 16-bit dtype at ``|x|`` (its subnormal
        spacing at the bottom; ``x`` within the dtype's range); a block format's
        half step at its block's scale (``_quant.half_step``)."""
        x = np.asarray(x, np.float64).reshape(-1)
        q = self.comm_dtype
        if q is None:
            return np.zeros_like(x)
        if isinstance(q, Quantized):
            return half_step(x, q)
        info = ml_dtypes.finfo(_np_dtype(q))
        tiny = float(info.smallest_subnormal)
        mant = int(info.nmant)
        # half the spacing of the binade holding |x|: 2**(floor(log2|x|) - nmant - 1)
        with np.errstate(divide="ignore"):
            e = np.floor(np.log2(np.abs(x)))
        spacing = np.where(np.abs(x) > 0, np.exp2(e - mant), tiny)
        return np.maximum(spacing, tiny) / 2


def _np_dtype(name: str):
    return {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[name]


_REGISTRY: dict[str, WireFormat] = {}


def register(fmt: WireFormat) -> WireFormat:
    """Add ``fmt`` (its name not yet taken); returns it."""
    if not isinstance(fmt, WireFormat):
        raise TypeError(f"register: expected a WireFormat, got {type(fmt).__name__}.")
    if fmt.name in _REGISTRY:
        raise ValueError(
            f"register: a wire format named {fmt.name!r} exists already "
            f"({_REGISTRY[fmt.name].summary}). Fix: give the new one another name."
        )
    _REGISTRY[fmt.name] = fmt
    return fmt


def wire_formats(*, lossy: bool | None = None, quantized: bool | None = None) -> list[WireFormat]:
    """The wire formats a synchronisation can use, by name, in order.

    Each is a :class:`jaxsync.WireFormat`: pass its ``comm_dtype`` to a factory
    (``comm_dtype=f.comm_dtype``); ``bytes_per_value()`` is what it sends per
    value, ``error_bound(x)`` how far one trip moves each value of ``x``. The
    benchmark's ``--wire``/``--formats`` choices and the cost model read them here.

    Args:
      lossy: ``True``: only the lossy formats; ``False``: only the lossless
        one(s); ``None``: all.
      quantized: ``True``: only the block-quantized formats
        (:class:`jaxsync.Quantized`); ``False``: the others; ``None``: all.

    Returns:
      a list of :class:`jaxsync.WireFormat`.

    Example:
      >>> import jaxsync
      >>> [f.name for f in jaxsync.wire_formats()]
      ['float32', 'bfloat16', 'float16', 'int8', 'e4m3', 'int4', 'e2m1']
      >>> [(f.name, f.bytes_per_value()) for f in jaxsync.wire_formats(quantized=True)][:2]
      [('int8', 1.001953125), ('e4m3', 1.001953125)]
    """
    out = list(_REGISTRY.values())
    if lossy is not None:
        out = [f for f in out if (not f.lossless) == lossy]
    if quantized is not None:
        out = [f for f in out if isinstance(f.comm_dtype, Quantized) == quantized]
    return out


def names(**filters) -> tuple[str, ...]:
    """The names of ``wire_formats(**filters)``."""
    return tuple(f.name for f in wire_formats(**filters))


def get(name: str) -> WireFormat:
    """The format called ``name``; a ``ValueError`` naming the choices if none is."""
    if name not in _REGISTRY:
        raise ValueError(
            f"wire format must be one of {tuple(_REGISTRY)}, got {name!r}. "
            "Fix: pick one of those (python -m jaxsync info lists them)."
        )
    return _REGISTRY[name]


def of(comm_dtype) -> WireFormat:
    """The registered format selected by a ``comm_dtype`` (a ``Quantized`` with its
    own block or rounding: the format of its bits and kind, with that spec)."""
    if isinstance(comm_dtype, Quantized):
        for f in wire_formats(quantized=True):
            q = f.comm_dtype
            if (q.bits, q.kind) == (comm_dtype.bits, comm_dtype.kind):
                return dataclasses.replace(f, comm_dtype=comm_dtype)
    name = "float32" if comm_dtype is None else str(jnp.dtype(comm_dtype))
    return get(name)


register(WireFormat("float32", None, "each buffer's own dtype: lossless"))
register(WireFormat("bfloat16", "bfloat16", "16 bits, float32's range, 8 significant bits"))
register(WireFormat("float16", "float16", "16 bits, 11 significant bits, range to 65504"))
register(WireFormat("int8", Quantized(bits=8, kind="int"), "int8 codes, a scale per block"))
register(WireFormat("e4m3", Quantized(bits=8, kind="float"), "float8 e4m3fn codes, scaled"))
register(WireFormat("int4", Quantized(bits=4, kind="int"), "int4 codes, two a byte, scaled"))
register(WireFormat("e2m1", Quantized(bits=4, kind="float"), "fp4 e2m1 codes, two a byte"))

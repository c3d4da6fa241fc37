"""The wire-format registry (``jaxsync.wire_formats``; issue 52, item 2): each
format's trip within its error bound, its bytes per value as the schedule sends
them, and the benchmark's lists read from it."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxsync
from jaxsync._core import _wire

NAMES = [f.name for f in jaxsync.wire_formats()]


def test_the_built_in_formats_in_order():
    assert NAMES == ["float32", "bfloat16", "float16", "int8", "e4m3", "int4", "e2m1"]
    assert _wire.names(lossy=False) == ("float32",)
    assert _wire.names(quantized=True) == ("int8", "e4m3", "int4", "e2m1")
    for f in jaxsync.wire_formats():
        assert isinstance(f, jaxsync.WireFormat) and f.summary
        # what selects it is a valid comm_dtype
        jaxsync.hierarchical_mean("i", comm=None, comm_dtype=f.comm_dtype)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    name=st.sampled_from(NAMES),
    values=st.lists(st.floats(-6e4, 6e4, allow_nan=False, width=32), min_size=1, max_size=300),
)
def test_a_trip_stays_within_the_error_bound(name, values):
    f = _wire.get(name)
    x = np.asarray(values, np.float32)
    got = np.asarray(f.roundtrip(x), np.float64)
    err = np.abs(got - x.astype(np.float64))
    bound = f.error_bound(x)
    assert (err <= bound).all(), (name, x[err > bound], err[err > bound], bound[err > bound])
    if f.lossless:
        assert (got == x).all()


def test_the_bound_is_tight_enough_to_mean_something():
    x = np.linspace(-3.0, 3.0, 4096)
    for f in jaxsync.wire_formats(lossy=True):
        bound = f.error_bound(x)
        # at most a few per cent of the block's largest value, never vacuous
        assert 0 < bound.max() <= 0.5 * 3.0 / (7 if f.name != "e2m1" else 2), f.name
        err = np.abs(np.asarray(f.roundtrip(x), np.float64) - x)
        assert err.max() > bound.max() / 8, f"{f.name}: the bound is far looser than the trip"


@pytest.mark.parametrize("name", NAMES)
def test_bytes_per_value_is_what_goes_on_the_wire(name):
    f = _wire.get(name)
    m = 4 * 2048
    q = f.comm_dtype
    if isinstance(q, jaxsync.Quantized):
        assert f.bytes_per_value() * m == q.wire_bytes(m)
    elif q is None:
        assert f.bytes_per_value(4) == 4 and f.bytes_per_value(2) == 2
    else:
        assert f.bytes_per_value() == jnp.dtype(q).itemsize == 2


def test_of_finds_the_format_a_comm_dtype_selects():
    assert _wire.of(None).name == "float32"
    assert _wire.of(jnp.bfloat16).name == "bfloat16"
    q = jaxsync.Quantized(bits=8, kind="float", block=64)
    f = _wire.of(q)
    assert f.name == "e4m3" and f.comm_dtype == q and f.bytes_per_value() == 1 + 4 / 64


def test_get_and_register_name_the_problem():
    with pytest.raises(ValueError, match=r"wire format must be one of \('float32',.*got 'fp8'"):
        _wire.get("fp8")
    with pytest.raises(ValueError, match=r"named 'int8' exists already.*Fix:"):
        _wire.register(_wire.WireFormat("int8", None, "again"))


def test_the_benchmark_reads_its_lists_from_the_registry(monkeypatch):
    from jaxsync.bench import compress, overlap, quality

    assert overlap.WIRES == ("float32", *_wire.names(quantized=True))
    assert set(quality.FORMATS) == set(NAMES) - {"float16"}
    assert set(compress.QUANT) == {"int8", "int4"}
    assert quality.wire("int4", block=64) == jaxsync.Quantized(bits=4, block=64)
    # a format registered later is one quality.wire() and overlap.wire_spec() know
    extra = _wire.WireFormat("int8b64", jaxsync.Quantized(bits=8, block=64), "test")
    monkeypatch.setitem(_wire._REGISTRY, extra.name, extra)
    assert overlap.wire_spec("int8b64") == extra.comm_dtype
    assert dataclasses.replace(extra.comm_dtype, block=2048) == jaxsync.Quantized(bits=8)

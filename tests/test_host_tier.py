"""The ``host_tier`` option: validated at the factory, in the agreed text, the
rule (16-bit wires by default, the environment's override) and the cost model's.

Across hosts the tier itself is tested on the emulated cluster
(tests/cluster/test_cluster_sync.py); here one process.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxsync
from jaxsync._comm import _host_tier
from jaxsync._core._config import make_config
from jaxsync.auto import _cost_ops
from jaxsync.auto._cost_ops import BucketInfo, ModelTopology

TIERED = {
    "flat_mean": jaxsync.flat_mean,
    "hierarchical_mean": jaxsync.hierarchical_mean,
    "two_dimensional_mean": jaxsync.two_dimensional_mean,
    "auto_mean": jaxsync.auto_mean,
}


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv(_host_tier.HOST_TIER_ENV, raising=False)


@pytest.mark.parametrize("name", sorted(TIERED))
def test_host_tier_is_validated_at_the_factory(name):
    fac = TIERED[name]
    for ok in (True, False, "auto"):
        fac(axis_name="i", comm=None, host_tier=ok)
    with pytest.raises(ValueError) as e:
        fac(axis_name="i", comm=None, host_tier="on")
    msg = str(e.value)
    assert name in msg and "host_tier must be one of (True, False, 'auto'), got 'on'" in msg
    assert "Fix: pass host_tier='auto'" in msg
    for bad in (1, None, np.bool_(True)):
        with pytest.raises(TypeError) as e:
            fac(axis_name="i", comm=None, host_tier=bad)
        msg = str(e.value)
        assert f"{name} got unexpected type for argument 'host_tier'" in msg, msg
        assert "expected: one of (True, False, 'auto')" in msg and "Fix:" in msg


def test_only_the_factories_that_can_take_the_tier_have_the_option():
    import inspect

    for name in (*TIERED, "naive_mean", "single_node_mean"):
        params = inspect.signature(getattr(jaxsync, name)).parameters
        assert ("host_tier" in params) == (name in TIERED), name
        if name in TIERED:
            assert params["host_tier"].default == "auto"
            assert "host_tier" in getattr(jaxsync, name).takes
    assert "host_tier: the host tier" in jaxsync.SyncOptions.__doc__


def test_a_bad_environment_override_fails_at_the_factory(monkeypatch):
    monkeypatch.setenv(_host_tier.HOST_TIER_ENV, "yes")
    with pytest.raises(ValueError, match=r"JAXSYNC_HOST_TIER must be 1 .* got 'yes'\. Fix:"):
        jaxsync.hierarchical_mean(axis_name="i", comm=None)


def test_describe_names_the_option_and_the_override(monkeypatch):
    cfg = lambda **kw: make_config("flat_mean", "flat", "i", None, **kw).describe()
    assert cfg().endswith(" host_tier auto")
    assert cfg(host_tier=False).endswith(" host_tier False")
    assert cfg(host_tier=True).endswith(" host_tier True")
    monkeypatch.setenv(_host_tier.HOST_TIER_ENV, "0")
    assert cfg().endswith(" host_tier auto JAXSYNC_HOST_TIER=0")
    monkeypatch.setenv(_host_tier.HOST_TIER_ENV, "1")
    assert cfg(host_tier=False).endswith(" host_tier False JAXSYNC_HOST_TIER=1")


def test_the_rule(monkeypatch):
    bf16, f32 = [(2, 600), (4, 400)], [(2, 400), (4, 400)]  # 60 % and 33 % 16-bit bytes
    assert _host_tier.chosen("auto", bf16) and not _host_tier.chosen("auto", f32)
    assert not _host_tier.chosen("auto", [(2, 500), (4, 500)])  # half is not most
    assert _host_tier.chosen(True, f32) and not _host_tier.chosen(False, bf16)
    monkeypatch.setenv(_host_tier.HOST_TIER_ENV, "1")
    assert _host_tier.chosen(False, f32) and _host_tier.chosen("auto", f32)
    monkeypatch.setenv(_host_tier.HOST_TIER_ENV, "0")
    assert not _host_tier.chosen(True, bf16) and not _host_tier.chosen("auto", bf16)


def test_the_wire_of_a_sync():
    from jaxsync._core._sync import _wire

    tree = {"a": jnp.zeros((3,), jnp.float32), "b": jnp.zeros((5,), jnp.bfloat16)}
    tree["n"] = jnp.zeros((9,), jnp.int32)  # passes through: not on the wire
    assert _wire(tree, None) == [(4, 12), (2, 10)]
    assert _wire(tree, "bfloat16") == [(2, 6), (2, 10)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["flat_mean", "hierarchical_mean", "two_dimensional_mean"])
def test_the_default_lowers_to_the_same_step_as_host_tier_false(name, dtype):
    """One process: the default is the step ``host_tier=False`` lowers to."""
    fac = getattr(jaxsync, name)
    devs = jax.devices()[:4]
    mesh = Mesh(np.array(devs), ("d",))
    tree = {"w": jnp.ones((4, 300), dtype), "b": jnp.ones((4, 7), jnp.float32)}

    def lowered(**kw):
        tx = fac(axis_name="d", comm=None, **kw)

        def body(t):
            t = jax.tree.map(lambda x: x[0], t)
            return jax.tree.map(lambda x: x[None], tx.update(t, tx.init(t))[0])

        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        return fn.lower(tree).as_text()

    default = lowered()
    assert default == lowered(host_tier=False)
    assert "all-reduce" in default or "all_reduce" in default or "reduce_scatter" in default


KB = 1024


def _host_ops(strategy, buckets, **topo):
    return [
        o
        for o in _cost_ops.strategy_ops(strategy, buckets, ModelTopology(**topo))
        if o.stage == "host"
    ]


def test_the_cost_model_follows_the_rule(monkeypatch):
    f32 = [BucketInfo("float32", 256 * KB, 3)]
    bf16 = [BucketInfo("bfloat16", 128 * KB, 3)]
    topo = dict(processes=4, hosts=2, local_devices=1)
    for strategy in ("flat", "hierarchical", "two_dimensional"):
        # by default (the native target, host_tier None: "auto"): 16-bit only
        assert _host_ops(strategy, bf16, **topo) and not _host_ops(strategy, f32, **topo)
        # comm_dtype bfloat16 on a float32 tree: 16 bits on the wire
        tiered = _cost_ops.strategy_ops(strategy, f32, ModelTopology(**topo), comm_itemsize=2)
        assert [o for o in tiered if o.stage == "host"], strategy
        assert _host_ops(strategy, f32, host_tier=True, **topo)
        assert not _host_ops(strategy, bf16, host_tier=False, **topo)
        assert _host_ops(strategy, bf16, host_tier="auto", **topo)
        assert not _host_ops(strategy, f32, host_tier="auto", **topo)
    assert not _host_ops("naive", bf16, **topo)
    # one host, or one process per host: no tier whatever the option
    assert not _host_ops("hierarchical", bf16, processes=4, hosts=1, host_tier=True)
    assert not _host_ops("hierarchical", bf16, processes=2, hosts=2, host_tier=True)
    one = ModelTopology(**topo)
    assert not _cost_ops.per_leaf_plan("two_dimensional", one, wire16=True)
    assert _cost_ops.per_leaf_plan("two_dimensional", one, wire16=False)
    monkeypatch.setenv(_host_tier.HOST_TIER_ENV, "1")
    assert _host_ops("hierarchical", f32, **topo)
    monkeypatch.setenv(_host_tier.HOST_TIER_ENV, "0")
    assert not _host_ops("hierarchical", bf16, **topo)
    assert _host_ops("hierarchical", bf16, host_tier=True, **topo)  # the model as told


def test_tune_records_the_rule(monkeypatch):
    from types import SimpleNamespace

    from jaxsync.auto._tune import _tiers_on

    cluster = SimpleNamespace(hosts=2, size=4)
    assert _tiers_on(cluster) == "auto"
    assert _tiers_on(SimpleNamespace(hosts=1, size=4)) is False
    monkeypatch.setenv(_host_tier.HOST_TIER_ENV, "1")
    assert _tiers_on(cluster) is True


def test_tier_chunks_counts_the_chunks_jaxsync_tier_cuts():
    """The pipelined tier (``jaxsync_tier``) is taken where a sync is more than one
    chunk: leader_only, consecutive buffers of one dtype fill chunks (a boundary
    may fall inside a buffer); two_dimensional, each buffer's slice in chunks."""
    from jaxsync._comm._mpi_ops import tier_chunks

    f32 = lambda n: np.zeros(n, np.float32)
    bf16 = lambda n: np.zeros(n, jnp.bfloat16)
    assert tier_chunks([f32(16)], 64, True, 2) == 1  # exactly one chunk
    assert tier_chunks([f32(17)], 64, True, 2) == 2
    assert tier_chunks([f32(10), f32(6), f32(1)], 64, True, 2) == 2  # shared chunks
    assert tier_chunks([f32(10), bf16(6), f32(1)], 64, True, 2) == 3  # a dtype closes one
    assert tier_chunks([bf16(32)], 64, True, 2) == 1  # bytes of the buffer's elements
    assert tier_chunks([f32(0)], 64, True, 2) == 0
    assert tier_chunks([f32(0), f32(3)], 64, False, 2) == 1  # empty: no chunk
    assert tier_chunks([f32(33)], 64, False, 2) == 3  # slices of 17 in chunks of 8
    assert tier_chunks([f32(5)], 1, False, 4) == 2  # at least one element a chunk


def test_program_takes_the_pipelined_call_where_the_host_ops_offer_it():
    calls = []

    class Ops:
        def __init__(self, name, pipe=False):
            self.name = name
            if pipe:
                self.pipelined = lambda cross, bufs, lo: calls.append(("tier", lo)) or ["p"]

        def reduce(self, bufs):
            calls.append((self.name, "reduce"))
            return bufs

        def bcast(self, bufs):
            calls.append((self.name, "bcast"))
            return bufs

    prog = lambda ops, bufs: calls.append((ops.name, "sum")) or bufs
    assert _host_tier.program(prog, Ops("host", True), Ops("cross"), True)(None, [1]) == ["p"]
    assert calls == [("tier", True)]
    calls.clear()
    none = Ops("host")
    none.pipelined = lambda cross, bufs, lo: None  # one chunk: the three calls
    assert _host_tier.program(prog, none, Ops("cross"), True)(None, [1]) == [1]
    assert calls == [("host", "reduce"), ("cross", "sum"), ("host", "bcast")]

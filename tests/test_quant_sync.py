"""comm_dtype=jaxsync.Quantized(...): the schedule in one process (8 fake devices,
the inter stage a mesh axis through jaxsync.AxisComm("host")).

A property test (hypothesis, derandomized) holds the quantized mean to its stated
bound per block against a float64 reference (tests/_quant_ref.py): random
trees, leaves of size 0, 1 and not a multiple of the block, all-zero blocks,
NaN/inf (NaN exactly on their blocks; check_finite sees them), 1 to 8 replicas,
under jit(shard_map), pmap and vmap. Then exact checks: error feedback (the
residual is the first quantization's error, and the next step sends it),
stochastic keys (reproducible, per step), option errors.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _quant_ref import check, examples, values
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxsync
from jaxsync._core._quant import roundtrip

SHAPES = [(1, 1), (1, 4), (2, 1), (2, 2), (2, 4), (3, 2), (4, 2), (8, 1)]
STRATS = ["hierarchical", "two_dimensional"]


def _tx(strategy, spec, **kw):
    make = getattr(jaxsync, f"{strategy}_mean")
    return make(
        axis_name="local", comm=jaxsync.AxisComm("host"), comm_dtype=spec, check_finite=True, **kw
    )


def _run(mode, tx, stacked, H, L):
    """Every replica's synchronised leaves and all_finite flags: (H, L, ...)."""

    def body(*leaves):
        out, st = tx.update(list(leaves), tx.init(list(leaves)))
        return out, st.all_finite

    if mode == "vmap":
        return jax.jit(jax.vmap(jax.vmap(body, axis_name="local"), axis_name="host"))(*stacked)
    if mode == "pmap":
        # pmap over the hosts (nested pmaps are not supported), vmap inside
        return jax.pmap(jax.vmap(body, axis_name="local"), axis_name="host")(*stacked)
    mesh = Mesh(np.array(jax.devices()[: H * L]).reshape(H, L), ("host", "local"))
    flat = [x.reshape(H * L, *x.shape[2:]) for x in stacked]

    def per_device(*leaves):
        out, ok = body(*[x[0] for x in leaves])
        return [y[None] for y in out], ok[None]

    spec = P(("host", "local"))
    out, ok = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=(spec, spec)))(
        *flat
    )
    return [y.reshape(H, L, *y.shape[1:]) for y in out], ok.reshape(H, L)


def _property(mode, example, shape, strategy):
    sizes, spec, special, seed = example
    H, L = shape
    vals = values(sizes, special, seed, H * L)
    stacked = [
        jnp.asarray(np.stack([vals[r][k] for r in range(H * L)]).reshape(H, L, -1))
        for k in range(len(sizes))
    ]
    out, ok = _run(mode, _tx(strategy, spec), stacked, H, L)
    out = [np.asarray(y).reshape(H * L, -1) for y in out]
    for y in out:  # every replica the same bits
        assert (y.view(np.uint32) == y[:1].view(np.uint32)).all()
    tree = [v for v in vals[0]]
    plan = jaxsync.make_plan(tree)
    check([y[0] for y in out], vals, plan, spec, H, L, strategy == "two_dimensional")
    finite = all(np.isfinite(v).all() for leaves in vals for v in leaves)
    assert (np.asarray(ok) == finite).all()


_SETTINGS = dict(
    derandomize=True, deadline=None, suppress_health_check=list(HealthCheck), database=None
)


@settings(max_examples=8, **_SETTINGS)
@given(examples(), st.sampled_from(SHAPES), st.sampled_from(STRATS))
def test_property_shard_map(example, shape, strategy):
    _property("shard_map", example, shape, strategy)


@settings(max_examples=3, **_SETTINGS)
@given(examples(), st.sampled_from(SHAPES[1:]), st.sampled_from(STRATS))
def test_property_pmap(example, shape, strategy):
    _property("pmap", example, shape, strategy)


@settings(max_examples=3, **_SETTINGS)
@given(examples(), st.sampled_from(SHAPES[1:]), st.sampled_from(STRATS))
def test_property_vmap(example, shape, strategy):
    _property("vmap", example, shape, strategy)


def test_error_feedback_residual_and_next_step():
    """Two hosts x one device, one leaf of 8 (a block): host h holds (h + 1) * v.
    Step 1's residual is exactly what the first quantization lost; step 2 sends
    gradient + residual."""
    spec = jaxsync.Quantized(bits=4, kind="int", block=8)
    tx = _tx("hierarchical", spec)
    v = np.array([7, 1.2, -3.4, 0.49, 2.5, -7, 0, 6.6], np.float32)
    g = jnp.asarray(np.stack([v, 2 * v])[:, None])  # (H=2, L=1, 8)

    def two_steps(x):
        st = tx.init([x])
        (o1,), st1 = tx.update([x], st)
        (o2,), st2 = tx.update([x], st1)
        return o1, o2, st1.residual[0], st2.step

    o1, o2, res, count = jax.jit(
        jax.vmap(jax.vmap(two_steps, axis_name="local"), axis_name="host")
    )(g)
    # predivided by 2 replicas; host 0's x = v / 2, scale 3.5 / 7 = 0.5: codes round(v)
    want = np.asarray(v / 2 - roundtrip(jnp.asarray(v / 2), spec))
    assert (np.asarray(res[0, 0]).view(np.uint32) == want.view(np.uint32)).all()
    assert np.abs(want).max() > 0  # something was lost, and kept
    assert (np.asarray(count) == 2).all()
    assert not np.array_equal(np.asarray(o1), np.asarray(o2))  # step 2 sent the residual


def test_error_feedback_off_keeps_zeros():
    spec = jaxsync.Quantized(bits=4, block=8, error_feedback=False)
    tx = _tx("hierarchical", spec)
    g = jnp.asarray(np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 1, 8))
    st = jax.vmap(
        jax.vmap(lambda x: tx.update([x], tx.init([x]))[1], axis_name="local"), axis_name="host"
    )(g)
    assert (np.asarray(st.residual[0]) == 0).all()


def test_stochastic_reproducible_and_per_step():
    spec = jaxsync.Quantized(bits=4, kind="float", block=8, rounding="stochastic")
    tx = _tx("hierarchical", spec)
    g = jnp.asarray(np.sin(np.arange(32, dtype=np.float32)).reshape(2, 1, 16))

    def steps(x):
        st = tx.init([x])
        (a,), st = tx.update([x], st)
        (b,), _ = tx.update(
            [x], st._replace(residual=tuple(jnp.zeros_like(r) for r in st.residual))
        )
        return a, b

    run = jax.jit(jax.vmap(jax.vmap(steps, axis_name="local"), axis_name="host"))
    a1, b1 = run(g)
    a2, b2 = run(g)
    assert np.array_equal(np.asarray(a1), np.asarray(a2))  # the same run repeats
    assert not np.array_equal(np.asarray(a1), np.asarray(b1))  # step 1's keys differ from 0's


def test_other_dtypes_pass_and_bf16_quantized():
    spec = jaxsync.Quantized(bits=8, block=4)
    tx = _tx("hierarchical", spec)
    tree = {"i": jnp.ones((2, 1, 3), jnp.int32), "b": jnp.full((2, 1, 4), 2.0, jnp.bfloat16)}

    def f(t):
        return tx.update(t, tx.init(t))[0]

    out = jax.jit(jax.vmap(jax.vmap(f, axis_name="local"), axis_name="host"))(tree)
    assert out["i"].dtype == jnp.int32 and (np.asarray(out["i"]) == 1).all()
    assert out["b"].dtype == jnp.bfloat16 and (np.asarray(out["b"], np.float32) == 2.0).all()


def _steps(tx, x, nsteps=3):
    """``nsteps`` updates of gradients ``x * (t + 1)`` on 2 hosts x 2 local
    replicas (vmap): the outputs per step and the last state."""

    def body(g):
        st = tx.init(g)
        outs = []
        for t in range(nsteps):
            out, st = tx.update(jax.tree.map(lambda y: y * (t + 1), g), st)
            outs.append(out)
        return outs, st

    return jax.jit(jax.vmap(jax.vmap(body, axis_name="local"), axis_name="host"))(x)


def _tree4():
    key = jax.random.PRNGKey(5)
    return [
        jax.random.normal(jax.random.fold_in(key, k), (2, 2, m)) for k, m in enumerate((9, 70, 40))
    ]


@pytest.mark.parametrize("strategy", STRATS)
def test_overlap_and_double_buffering_take_the_quantized_wire(strategy):
    """overlap=True (per bucket) and double_buffering=True (a step late) with a
    quantized wire (both refused before): overlap's outputs and residuals are
    overlap=False's bits (stochastic keys by the bucket's place in the sync);
    double buffering applies the last step's quantized mean, bit for bit, its
    residuals in DoubleBufferState.wire, laid out per replica by state_specs.
    (Across processes, on the communicator's lane: tests/mpi/test_quant_mpi.py.)"""
    q = jaxsync.Quantized(bits=4, block=16, rounding="stochastic")
    kw = dict(pack_threshold=128)  # three buffers, in two overlap buckets of 256 bytes
    plain, st0 = _steps(_tx(strategy, q, overlap=False, **kw), _tree4())
    over, st1 = _steps(_tx(strategy, q, overlap=True, overlap_bucket_bytes=256, **kw), _tree4())
    for a, b in zip(jax.tree.leaves((plain, st0.residual)), jax.tree.leaves((over, st1.residual))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    q = jaxsync.Quantized(bits=8, block=16)
    plain, st0 = _steps(_tx(strategy, q, overlap=False, **kw), _tree4())
    double, st1 = _steps(_tx(strategy, q, overlap=False, double_buffering=True, **kw), _tree4())
    assert isinstance(st1, jaxsync.DoubleBufferState)
    assert isinstance(st1.wire, jaxsync.QuantState)
    assert not any(np.asarray(y).any() for y in double[0])
    for a, b in zip(jax.tree.leaves(plain[:2]), jax.tree.leaves(double[1:])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(st1.wire.step[0, 0]) == 3 and np.abs(np.asarray(st1.wire.residual[0])).max() > 0
    tx = _tx(strategy, q, double_buffering=True)
    specs = jaxsync.state_specs(jax.eval_shape(tx.init, [jnp.ones(10), jnp.ones(3)]), "local")
    assert specs.pending == [P("local"), P("local")] and specs.all_finite == P()
    assert specs.wire == jaxsync.QuantState(P(), (P("local"),), P())


def test_weights_with_double_buffering_and_a_quantized_wire_raise():
    with pytest.raises(ValueError, match=r"weights=True with double_buffering=True.*Fix"):
        jaxsync.hierarchical_mean(
            axis_name="local",
            comm=jaxsync.AxisComm("host"),
            comm_dtype=jaxsync.Quantized(),
            double_buffering=True,
            weights=True,
        )


def test_auto_takes_the_quantized_wire_and_sync_gradients_needs_a_state():
    """auto_mean with comm_dtype=Quantized (refused before): the strategy the cost
    model picks runs the quantized schedule (hierarchical's bits here)."""
    q = jaxsync.Quantized(bits=4)
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(3), (2, 4, 300)), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no measured profile here: the built-in one
        auto = _run("shard_map", _tx("auto", q), [x], 2, 4)
    named = _run("shard_map", _tx("hierarchical", q), [x], 2, 4)
    plain = _run("shard_map", _tx("hierarchical", None), [x], 2, 4)
    np.testing.assert_array_equal(auto[0][0], named[0][0])
    assert not np.array_equal(auto[0][0], plain[0][0])  # quantized, not float32
    with pytest.raises(ValueError, match="needs a state"):
        jax.vmap(
            lambda x: jaxsync.sync_gradients(x, axis_name="d", comm=None, comm_dtype=q),
            axis_name="d",
        )(jnp.ones((2, 3)))
    with pytest.raises(TypeError, match="QuantState"):
        tx = jaxsync.hierarchical_mean(axis_name=None, comm=None, comm_dtype=q)
        tx.update({"w": jnp.ones(3)}, optax.EmptyState())


def test_host_tier_reduces_the_sums_only_and_skips_the_pipelined_call():
    """The host tier (MPI, processes of several hosts) with a quantized program:
    the host's float32 reduce takes the sums, never the residuals; the program
    runs among the hosts' leaders; the sums and new residuals are broadcast; the
    pipelined call (which would sum in float32 across hosts) is not taken."""
    from jaxsync._comm import _host_tier

    calls = []

    class Ops:
        def __init__(self, name):
            self.name = name
            self.pipelined = lambda cross, bufs, lo: calls.append("tier") or ["p"]

        def reduce(self, bufs):
            calls.append((self.name, "reduce", list(bufs)))
            return [b * 10 for b in bufs]

        def bcast(self, bufs):
            calls.append((self.name, "bcast", list(bufs)))
            return bufs

    def prog(ops, bufs):
        calls.append((ops.name, "prog", list(bufs)))
        return [b + 1 for b in bufs]

    prog.reduced = 2  # two sums, then two residuals
    out = _host_tier.program(prog, Ops("host"), Ops("cross"), True)(None, [1, 2, 3, 4])
    assert out == [11, 21, 4, 5]
    assert calls == [
        ("host", "reduce", [1, 2]),
        ("cross", "prog", [10, 20, 3, 4]),
        ("host", "bcast", [11, 21, 4, 5]),
    ]


def test_state_specs_lay_the_residuals_out_per_replica():
    # (state_specs gave the residuals P(): under shard_map with one device per
    # process their replication cannot be inferred, and the step did not trace)
    tx = _tx("hierarchical", jaxsync.Quantized(bits=8, block=4))
    shapes = jax.eval_shape(tx.init, [jnp.ones(10), jnp.ones(3)])
    specs = jaxsync.state_specs(shapes, "local")
    assert specs == jaxsync.QuantState(P(), (P("local"),), P())

"""Tests of ``jaxsync.replica_mean`` (jaxsync/_core/_replica.py): non-gradient values.

BatchNorm-like statistics from integer-valued data, so every mean is exact by
construction and compared bitwise, under jit(shard_map), pmap and vmap. The
invariant case (values already equal on every device, e.g. ``lax.pmean``'d
statistics, typed so by shard_map) is the one issue 26 reported against
``sync_gradients``, which divides such a value by the replica count again.
The multi-process cases are in tests/mpi/worker_replica.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _common import HL, MESH1, MESH2, N, bits  # noqa: E402
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsync

ROWS, COLS = 4, 3


def _data(dtype=jnp.float32):
    # Replica r holds rows of r * 16 + j: every batch mean and variance is a
    # multiple of 1/16 (exact in f32, bf16 and f16 for these sizes).
    x = np.arange(N * ROWS * COLS, dtype=np.float64).reshape(N, ROWS, COLS)
    return jnp.asarray(x, dtype)


def _stats(xb):
    """This replica's batch statistics (BatchNorm's), as a flax-like tree."""
    return {"batch_stats": {"mean": xb.mean(0), "var": xb.var(0)}, "loss": jnp.sum(xb) / 8}


def _expected(x):
    """Closed form: the mean over replicas of each replica's own statistics."""
    per = [jax.tree.map(np.asarray, _stats(np.asarray(x[r], np.float64))) for r in range(N)]
    return jax.tree.map(lambda *a: np.mean(np.stack(a), 0), *per)


def _assert_bits(got, want, dtype):
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(
            bits(g), bits(np.asarray(w, dtype)), err_msg=jax.tree_util.keystr(path)
        )


def _on_mesh(body, mesh, spec, x):
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=P()))
    return f(jax.device_put(x, NamedSharding(mesh, spec)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_per_replica_stats_are_averaged_exactly_under_shard_map(dtype):
    x = _data(dtype)
    out = _on_mesh(
        lambda xb: jaxsync.replica_mean(_stats(xb[0]), axis_name="i", comm=None),
        MESH1,
        P("i"),
        x,
    )
    _assert_bits(out, _expected(x), dtype)


def test_already_averaged_stats_are_unchanged_not_divided_again():
    """Issue 26: stats already pmean'd over the axis are invariant. sync_gradients
    reads an invariant leaf as a sum autodiff took and divides it by 8 again (the
    report: variance 0.77 -> 0.0014 through BatchNorm's running averages);
    replica_mean returns it unchanged, bit for bit."""
    x = _data()
    # 0.1-like values: a division by 8 and back, or a sum of 8 copies, would show.
    x = x / 10

    def body(xb):
        avg = jax.tree.map(lambda a: lax.pmean(a, "i"), _stats(xb[0]))
        return (
            avg,
            jaxsync.replica_mean(avg, axis_name="i", comm=None),
            jaxsync.sync_gradients(avg, axis_name="i", comm=None),
        )

    avg, got, divided = _on_mesh(body, MESH1, P("i"), x)
    _assert_bits(got, avg, np.float32)
    # What the issue reported, kept as the documented reading of sync_gradients.
    for a, d in zip(jax.tree.leaves(avg), jax.tree.leaves(divided)):
        np.testing.assert_array_equal(np.asarray(d), np.asarray(a) / N)


def test_invariant_leaves_are_unchanged_for_any_axis_size():
    """Three devices: 3 * x / 3 is not always x in float32; the leaf is kept as is."""
    mesh = Mesh(np.array(jax.devices()[:3]), ("i",))
    v = jnp.asarray(np.float32([0.1, 1 / 3, 0.7, 12345.678]))

    def body(_):
        return jaxsync.replica_mean({"v": v, "w": v * 2}, axis_name="i", comm=None)

    out = _on_mesh(body, mesh, P("i"), jnp.zeros((3, 1)))
    _assert_bits(out, {"v": v, "w": v * 2}, np.float32)


def test_one_device_mesh_gives_a_replicated_result():
    """A mesh of one device: each leaf is its own mean, bit for bit, and typed
    equal over the axis (``out_specs=P()`` refused it before: varying over "i")."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("i",))
    x = _data()[:1]
    out = _on_mesh(lambda xb: jaxsync.replica_mean(_stats(xb[0]), axis_name="i"), mesh, P("i"), x)
    _assert_bits(out, _expected(np.concatenate([x] * N)), np.float32)


def test_mixed_tree_varying_and_invariant_leaves():
    x = _data()

    def body(xb):
        mine = _stats(xb[0])
        return jaxsync.replica_mean(
            {"mine": mine, "avg": jax.tree.map(lambda a: lax.pmean(a, "i"), mine)},
            axis_name="i",
            comm=None,
        )

    out = _on_mesh(body, MESH1, P("i"), x)
    want = _expected(x)
    _assert_bits(out, {"avg": want, "mine": want}, np.float32)


def test_axiscomm_leaf_invariant_over_local_is_averaged_over_hosts():
    """2 hosts x 4 devices, AxisComm("host"): statistics pmean'd on each host (as
    flax's BatchNorm(axis_name="local") does) are averaged over the hosts."""
    x = _data()

    def body(xb):
        mine = _stats(xb[0])
        local = jax.tree.map(lambda a: lax.pmean(a, "local"), mine)
        everywhere = jax.tree.map(lambda a: lax.pmean(a, HL), mine)
        out = jaxsync.replica_mean(
            {"mine": mine, "local": local, "all": everywhere},
            axis_name="local",
            comm=jaxsync.AxisComm("host"),
        )
        return out, everywhere

    out, everywhere = _on_mesh(body, MESH2, P(HL), x)
    want = _expected(x)
    _assert_bits(out["mine"], want, np.float32)
    _assert_bits(out["local"], want, np.float32)
    _assert_bits(out["all"], everywhere, np.float32)


def test_invariant_float16_near_its_limit_does_not_overflow():
    """A float16 leaf invariant over "local" stands for 4 equal values: scaled by 4
    in float16 it would be inf (4 x 30000 > 65504); the mean over hosts is finite."""
    v = jnp.float16(30000.0)

    def body(xb):
        host = lax.axis_index("host").astype(jnp.float32)
        # pmean'd in float32 (a float16 pmean would overflow itself), then float16
        local_mean = lax.pmean(xb[0, 0, 0] * 0 + 30000.0 - host * 16, "local").astype(v.dtype)
        return jaxsync.replica_mean(local_mean, axis_name="local", comm=jaxsync.AxisComm("host"))

    out = _on_mesh(body, MESH2, P(HL), _data())
    np.testing.assert_array_equal(bits(out), bits(np.float16(30000.0 - 8)))


def test_pmap_and_vmap():
    x = _data()
    f = lambda xb: jaxsync.replica_mean(_stats(xb), axis_name="i", comm=None)  # noqa: E731
    want = _expected(x)
    for out in (jax.pmap(f, axis_name="i")(x), jax.jit(jax.vmap(f, axis_name="i"))(x)):
        for r in range(N):
            _assert_bits(jax.tree.map(lambda a: a[r], out), want, np.float32)
    # Without axis types an already-averaged value is averaged again: equal values
    # give themselves back (exact here: integer-valued data, 8 replicas).
    g = lambda xb: jaxsync.replica_mean(  # noqa: E731
        jax.tree.map(lambda a: lax.pmean(a, "i"), _stats(xb)), axis_name="i", comm=None
    )
    out = jax.vmap(g, axis_name="i")(x)
    _assert_bits(jax.tree.map(lambda a: a[3], out), want, np.float32)


def test_idempotent():
    x = _data() / 10
    once = lambda xb: jaxsync.replica_mean(_stats(xb[0]), axis_name="i", comm=None)  # noqa: E731
    twice = lambda xb: jaxsync.replica_mean(once(xb), axis_name="i", comm=None)  # noqa: E731
    _assert_bits(_on_mesh(twice, MESH1, P("i"), x), _on_mesh(once, MESH1, P("i"), x), np.float32)


def test_plain_jit_one_device_axis_name_none():
    stats = {"mean": jnp.asarray([1.5, 2.0])}
    out = jax.jit(lambda s: jaxsync.replica_mean(s, axis_name=None, comm=None))(stats)
    _assert_bits(out, stats, np.float32)


def test_bad_arguments_name_what_to_do():
    with pytest.raises(TypeError, match=r"replica_mean .*\['count'\].*int32.*astype"):
        jax.vmap(lambda t: jaxsync.replica_mean(t, axis_name="i", comm=None), axis_name="i")(
            {"count": jnp.ones(4, jnp.int32)}
        )
    with pytest.raises(NameError, match="'j' is not bound"):
        jax.vmap(lambda t: jaxsync.replica_mean(t, axis_name="j", comm=None), axis_name="i")(
            jnp.ones(4)
        )
    with pytest.raises(TypeError, match="replica_mean"):
        jaxsync.replica_mean(jnp.ones(2), axis_name=3, comm=None)
    with pytest.raises(TypeError, match="comm"):
        jaxsync.replica_mean(jnp.ones(2), axis_name=None, comm="world")
    with pytest.raises(TypeError):  # keyword-only, as sync_gradients
        jaxsync.replica_mean(jnp.ones(2), "i")  # type: ignore[misc]


@pytest.mark.parametrize(
    "leaf, got", [(jax.nn.relu, "custom_jvp relu"), (jnp.tanh, "PjitFunction tanh"), (0.5, "float")]
)
def test_a_leaf_that_is_not_an_array_names_it_and_the_filter(leaf, got):
    """A function leaf (an equinox model's) is not "cast it" material (issue 32)."""
    f = jax.vmap(
        lambda m: jaxsync.replica_mean({"mean": m, "act": leaf}, axis_name="i", comm=None),
        axis_name="i",
    )
    with pytest.raises(TypeError) as e:
        f(jnp.arange(4.0))
    msg = str(e.value)
    assert msg.startswith("replica_mean got unexpected type for the leaf ['act']"), msg
    assert f"got: {got}" in msg and "not an array" in msg, msg
    assert "eqx.filter(tree, eqx.is_array)" in msg and "astype" not in msg, msg
    # The fix: the arrays only (eqx.filter leaves None where a leaf was not one).
    g = jax.vmap(
        lambda m: jaxsync.replica_mean({"mean": m, "act": None}, axis_name="i", comm=None),
        axis_name="i",
    )
    out = g(jnp.arange(4.0))
    assert out["act"] is None and (bits(out["mean"]) == bits(jnp.full(4, 1.5))).all()


def test_public():
    assert "replica_mean" in jaxsync.__all__

"""overlap= and double_buffering= in one process: validation and semantics.

The multi-process behaviour (exact bits against the blocking sync, ordering,
donation, checkpoints, exit) is in tests/mpi/test_overlap_mpi.py.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsync
from jaxsync._core._sync import overlap_groups

# The semantics tests below run in one process on purpose: overlap and double
# buffering then warn that there is no inter-process stage (tested on its own).
ONE_PROCESS = pytest.mark.filterwarnings("ignore:.* no inter-process stage:UserWarning")


@pytest.mark.parametrize(
    "kw, err, words",
    [
        (dict(overlap=1), TypeError, "'overlap'"),
        (dict(overlap="on"), ValueError, r"overlap must be one of \(True, False, 'auto'\)"),
        (dict(double_buffering="yes"), TypeError, "'double_buffering'"),
        (dict(overlap=True, overlap_bucket_bytes=0), ValueError, "overlap_bucket_bytes"),
        (dict(overlap=True, overlap_bucket_bytes=1.5), TypeError, "overlap_bucket_bytes"),
        (dict(overlap=False, overlap_bucket_bytes=2**20), ValueError, "overlap=True"),
    ],
)
@pytest.mark.parametrize("factory", ["hierarchical_mean", "auto_mean"])
def test_options_are_validated_at_factory_time(kw, err, words, factory):
    with pytest.raises(err, match=words):
        getattr(jaxsync, factory)("i", comm=None, **kw)


def test_groups_follow_backward_order_first_small():
    assert overlap_groups([4, 4, 4, 4, 4], bucket_bytes=8, first_bytes=4) == [[4], [3, 2], [1, 0]]
    assert overlap_groups([100], bucket_bytes=8) == [[0]]
    got = overlap_groups([1] * 10, bucket_bytes=3, first_bytes=1)
    assert sorted(i for g in got for i in g) == list(range(10))


def _tree(r):
    return [{"w": jnp.full((3, 2), 1.0) * (r + k), "b": jnp.arange(2.0) * r} for k in range(4)]


@ONE_PROCESS
@pytest.mark.parametrize(
    "factory", ["flat_mean", "hierarchical_mean", "two_dimensional_mean", "auto_mean"]
)
def test_overlap_gives_the_same_bits_in_one_process(factory):
    make = getattr(jaxsync, factory)
    plain, over = make("i", comm=None), make("i", comm=None, overlap=True, overlap_bucket_bytes=8)
    f = lambda tx: jax.vmap(lambda r: tx.update(_tree(r), tx.init(_tree(r)))[0], axis_name="i")  # noqa: E731
    r = jnp.arange(4.0)
    a, b = f(plain)(r), f(over)(r)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@ONE_PROCESS
@pytest.mark.parametrize("factory", ["hierarchical_mean", "auto_mean"])
def test_double_buffering_applies_last_steps_mean(factory):
    make = getattr(jaxsync, factory)
    tx = optax.chain(make("i", comm=None, double_buffering=True), optax.sgd(1.0))
    grads = [jax.vmap(_tree)(jnp.arange(4.0) + 10 * t) for t in range(3)]

    def run():
        state = jax.vmap(tx.init, axis_name="i")(grads[0])
        outs = []
        for g in grads:
            u, state = jax.vmap(tx.update, axis_name="i")(g, state)
            outs.append(u)
        return outs, state

    outs, state = run()
    assert isinstance(state[0], jaxsync.DoubleBufferState)
    for x in jax.tree.leaves(outs[0]):  # the first step applies zeros
        assert not np.asarray(x).any()
    for t in (1, 2):
        want = jax.tree.map(lambda g: -jnp.mean(g, axis=0, keepdims=True) + 0 * g, grads[t - 1])
        for x, y in zip(jax.tree.leaves(outs[t]), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(jax.tree.leaves(state[0].pending), jax.tree.leaves(grads[-1])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # kept unreduced


@ONE_PROCESS
def test_double_buffering_rejects_a_state_of_another_transform():
    tx = jaxsync.flat_mean("i", comm=None, double_buffering=True)
    with pytest.raises(TypeError, match="DoubleBufferState"):
        jax.vmap(lambda g: tx.update(g, optax.EmptyState()), axis_name="i")(jnp.ones((2, 3)))


@pytest.mark.parametrize(
    "factory", ["naive_mean", "flat_mean", "hierarchical_mean", "two_dimensional_mean", "auto_mean"]
)
@pytest.mark.parametrize(
    "kw, names",
    [
        (dict(overlap=True), ["overlap=True"]),
        (dict(double_buffering=True), ["double_buffering=True", "staleness", "0.883"]),
        (dict(overlap=True, double_buffering=True), ["overlap=True", "double_buffering=True"]),
    ],
    ids=["overlap", "double", "both"],
)
@pytest.mark.parametrize("comm", [None, "auto"])
def test_no_inter_process_stage_warns_once_at_factory_time(factory, kw, names, comm):
    """One UserWarning when the factory is called (comm=None, or "auto" without an
    MPI launch), naming the option, why it does not pay, its cost and the fix; none
    when the step is traced and run."""
    make = getattr(jaxsync, factory)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", "jaxsync auto. .* got no profile")
        tx = make("i", comm=comm, **kw)
    mine = [w for w in got if "no inter-process stage" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in got]
    msg = str(mine[0].message)
    assert mine[0].category is UserWarning and mine[0].filename == __file__
    assert msg.startswith(f"{factory}: no inter-process stage (comm={comm!r}")
    for word in [*names, "Fix: drop", "crosses processes"]:
        assert word in msg, (word, msg)
    if "double_buffering" not in kw:
        assert "staleness" not in msg
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # init, update, tracing: nothing more
        g = {"w": jnp.arange(4.0)}
        jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="i")(g)


def test_an_inter_process_stage_does_not_warn():
    """AxisComm is an inter-process stage (XLA collectives over a mesh axis, across
    processes after jax.distributed): no warning. (MPI: tests/mpi/test_mpi.py.)"""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxsync.hierarchical_mean("i", comm=jaxsync.AxisComm("h"), overlap=True)
        jaxsync.flat_mean("i", comm=jaxsync.AxisComm("h"), double_buffering=True)
        jaxsync.hierarchical_mean("i", comm=None)  # neither option: nothing to say


TRANSFORMS = ["naive_mean", "flat_mean", "hierarchical_mean", "two_dimensional_mean"]


def test_the_default_is_auto():
    import inspect

    for name in [*TRANSFORMS, "auto_mean"]:
        fac = getattr(jaxsync, name)
        assert inspect.signature(fac).parameters["overlap"].default == "auto", name
        # its text is SyncOptions', to which every factory's docstring leads (or mean's)
        assert "jaxsync.SyncOptions" in fac.__doc__ or "jaxsync.mean" in fac.__doc__
    assert jaxsync.SyncOptions().overlap == "auto"
    assert '``"auto"`` (default): on where the inter-process' in jaxsync.SyncOptions.__doc__
    # a bucket size with the default is for when it is on: accepted
    jaxsync.hierarchical_mean("i", comm=None, overlap_bucket_bytes=2**20)


def test_auto_is_on_where_the_sync_spans_hosts():
    """``resolve_overlap``: "auto" follows the communicator's host count (the
    topology's, ``Comms.hosts``); True and False force it."""
    from types import SimpleNamespace

    from jaxsync._comm import _axis_backend
    from jaxsync._core._overlap import resolve_overlap

    def mpi(hosts, native=True):
        return SimpleNamespace(comms=SimpleNamespace(hosts=hosts), native=native)

    assert resolve_overlap("auto", mpi(2)) and resolve_overlap("auto", mpi(4))
    assert not resolve_overlap("auto", mpi(1))
    # mpi4jax (GPU) and host staging block: nothing would overlap, auto stays off
    assert not resolve_overlap("auto", mpi(2, native=False))
    assert resolve_overlap(True, mpi(2, native=False))
    assert not resolve_overlap("auto", _axis_backend.LocalBackend())
    assert not resolve_overlap("auto", _axis_backend.AxisBackend(jaxsync.AxisComm("h")))
    assert resolve_overlap(True, mpi(1)) and not resolve_overlap(False, mpi(2))


@pytest.mark.parametrize("name", TRANSFORMS)
def test_the_default_lowers_to_overlap_false_in_one_process(name):
    """One process (no inter-process stage): the default is off, no warning, and
    the lowered step is overlap=False's. Under mpirun on one host and with two
    hosts: tests/mpi/test_overlap_mpi.py."""
    fac = getattr(jaxsync, name)
    tree = {"w": jnp.ones((4, 300)), "b": jnp.ones((4, 7))}

    def lowered(**kw):
        tx = fac("i", comm=None, **kw)
        f = jax.vmap(lambda t: tx.update(t, tx.init(t))[0], axis_name="i")
        return jax.jit(f).lower(tree).as_text()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        default = lowered()
        assert default == lowered(overlap=False)

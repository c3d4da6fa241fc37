"""broadcast_params with leaves that are not arrays, in one process (issue 32).

An equinox model holds functions (``jax.nn.relu``) and Python scalars beside its
arrays. The same call behaves the same with ``comm=None``, ``AxisComm`` and an
MPI-like communicator (a fake one here, where every process agrees and the
broadcast moves nothing; the real one under mpirun is in tests/mpi/test_mpi.py):
Python scalars keep their type and value, static leaves pass through as they
are, and a leaf that can be neither is refused with the same error naming it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _common import FakeComm

import jaxsync


@pytest.fixture(params=["none", "axis", "mpi"])
def comm(request):
    if request.param == "none":
        yield None
    elif request.param == "axis":
        yield jaxsync.AxisComm("host")
    else:
        fake = FakeComm()
        yield fake
        jaxsync.free_communicators(fake)


def _model():
    return {
        "layers": [{"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.zeros(3, jnp.bfloat16)}],
        "act": jax.nn.relu,
        "final": jnp.tanh,
        "scale": lambda x: 2 * x,
        "p": 0.1,
        "n": 3,
        "big": 2**40 + 1,
        "inference": False,
        "z": 1.5 - 2j,
        "np32": np.float32(0.25),
        "name": "mlp",
    }


def test_non_array_leaves_pass_through_with_any_comm(comm):
    tree = _model()
    out = jaxsync.broadcast_params(tree, comm=comm)
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    for key in ("act", "final", "scale", "name"):
        assert out[key] is tree[key], key  # static: the same object
    for key in ("p", "n", "big", "inference", "z", "np32"):
        assert type(out[key]) is type(tree[key]) and out[key] == tree[key], (key, out[key])
    for got, want in zip(jax.tree.leaves(out["layers"]), jax.tree.leaves(tree["layers"])):
        assert isinstance(got, jax.Array) and got.dtype == want.dtype
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


def test_a_leaf_with_a_dtype_but_no_values_is_refused_naming_it(comm):
    tree = {"model": {"w": jnp.ones(2), "spec": jax.ShapeDtypeStruct((2,), jnp.float32)}}
    with pytest.raises(TypeError) as e:
        jaxsync.broadcast_params(tree, comm=comm)
    msg = str(e.value)
    assert msg.startswith("broadcast_params cannot broadcast the leaf ['model']['spec']")
    assert "jax.ShapeDtypeStruct" in msg and "eqx.filter(model, eqx.is_array)" in msg
    with pytest.raises(TypeError) as again:  # the same words with every comm
        jaxsync.broadcast_params(tree, comm=None)
    assert str(again.value) == msg


def test_a_traced_leaf_is_refused_naming_it():
    f = jax.jit(lambda w: jaxsync.broadcast_params({"w": w}, comm=None))
    with pytest.raises(TypeError, match=r"leaf \['w'\]: it is a traced value.*outside jit"):
        f(jnp.ones(2))


def test_an_equinox_model():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.PRNGKey(0))
    comm = FakeComm()
    try:
        out = jaxsync.broadcast_params(model, comm=comm)
    finally:
        jaxsync.free_communicators(comm)
    assert out.activation is model.activation
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(model)):
        if eqx.is_array(want):
            assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
        else:
            assert got is want or got == want

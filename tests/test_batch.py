"""jaxsync.local_batch in one process (8 fake devices): this process's rows of a
global batch, split over its devices; a stand-in communicator plays rank 1 of 2
(tests/mpi/test_batch_mpi.py runs it under mpirun -n 2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _common import MESH1, MESH2
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsync


class _Comm:
    """What local_batch reads of an mpi4py communicator."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size


def _batch(rows=16):
    return {
        "x": np.arange(rows * 3, dtype=np.float32).reshape(rows, 3),
        "y": np.arange(rows, dtype=np.int32),
    }


def test_one_process_gets_every_row_split_over_its_devices():
    out = jaxsync.local_batch(_batch(), MESH1)
    assert out["x"].sharding == NamedSharding(MESH1, P("i"))
    np.testing.assert_array_equal(np.asarray(out["x"]), _batch()["x"])
    shards = sorted(out["y"].addressable_shards, key=lambda s: s.device.id)
    assert [s.data.tolist() for s in shards] == [[2 * d, 2 * d + 1] for d in range(8)]


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_gets_its_rows(rank):
    want = _batch()["x"][8 * rank : 8 * rank + 8]
    for where in (MESH2, NamedSharding(MESH2, P(("host", "local")))):
        out = jaxsync.local_batch(_batch(), where, comm=_Comm(rank, 2))
        assert out["x"].shape == (8, 3) and out["y"].dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(out["x"]), want)
        for s in out["x"].addressable_shards:  # one row a device, in the mesh's order
            assert s.data.shape == (1, 3)


def test_the_readme_step_takes_it():
    tx = jaxsync.hierarchical_mean(axis_name="i", comm=None)

    def step(w, x):
        g = jax.grad(lambda w: jnp.sum(x @ w))(w)
        return tx.update(g, tx.init(g))[0]

    f = jax.jit(jax.shard_map(step, mesh=MESH1, in_specs=(P(), P("i")), out_specs=P()))
    g = f(jnp.zeros(3), jaxsync.local_batch(_batch(), MESH1)["x"])
    np.testing.assert_array_equal(np.asarray(g), _batch()["x"].reshape(8, 2, 3).sum(1).mean(0))


def test_uneven_rows_and_bad_arguments_raise_clearly():
    with pytest.raises(ValueError, match=r"\['x'\] has 15 rows, .* over 2 processes x 8 dev"):
        jaxsync.local_batch(_batch(15), MESH1, comm=_Comm(0, 2))
    with pytest.raises(ValueError, match=r"12 rows.*2 processes x 8 devices.*multiple of 16"):
        jaxsync.local_batch(_batch(12), MESH1, comm=_Comm(1, 2))
    with pytest.raises(ValueError, match=r"\['s'\] is a scalar"):
        jaxsync.local_batch({"s": np.float32(1)}, MESH1)
    with pytest.raises(TypeError, match="must be a jax.sharding.Mesh or NamedSharding, got str"):
        jaxsync.local_batch(_batch(), "i")


def test_the_signature_is_typed():
    import inspect

    sig = inspect.signature(jaxsync.local_batch)
    assert all(p.annotation is not p.empty for p in sig.parameters.values())
    assert sig.return_annotation is not sig.empty

"""Orbax checkpoints of every jaxsync state, one directory per rank (docs/checkpoints.md).

For each transform (a chain with ``hierarchical_mean``, ``powersgd_mean``, ``sign_mean``,
and ``double_buffering=True``), a few steps under ``shard_map`` with the state made from
``jaxsync.state_specs``, a save with ``ocp.StandardCheckpointer`` into
``DIR/rank{R}/NAME``, a restore into ``jax.ShapeDtypeStruct``s carrying the step's
shardings, and then: the same tree structure, the same sharding for every leaf, the same
bytes on every device (each device its own residual), and the same next step, bitwise.
:func:`roundtrip` runs here on 8 fake devices and, per rank, under ``mpirun -n 2``
(tests/mpi/worker_orbax.py).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp  # the test extra installs orbax-checkpoint
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsync

AXIS = "local"
STEPS = 3
CASES = {
    "hierarchical_mean": lambda: jaxsync.hierarchical_mean(axis_name=AXIS),
    "powersgd_mean": lambda: jaxsync.powersgd_mean(axis_name=AXIS, rank=2),
    "sign_mean": lambda: jaxsync.sign_mean(axis_name=AXIS),
    "double_buffering": lambda: jaxsync.hierarchical_mean(axis_name=AXIS, double_buffering=True),
}
# Leaves each device holds its own of: the residual of the compressed w (b, 32 values,
# is averaged exactly), or the pending gradients of w and b.
PER_REPLICA = {"hierarchical_mean": 0, "powersgd_mean": 1, "sign_mean": 1, "double_buffering": 2}
# In one process double buffering has no inter-process sums to hide and says so.
NO_INTER_PROCESS = "ignore:hierarchical_mean. no inter-process stage:UserWarning"


def _params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w": jax.random.normal(k1, (64, 32)), "b": jax.random.normal(k2, (32,))}


def _loss(params, x):
    return ((x @ params["w"] + params["b"]) ** 2).mean()


def training(tx, mesh):
    """``(specs, init, step)`` of ``tx`` under ``shard_map`` on ``mesh``."""
    specs = jaxsync.state_specs(jax.eval_shape(tx.init, _params()), AXIS)
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))

    def local_step(params, opt_state, x):
        updates, opt_state = tx.update(jax.grad(_loss)(params, x), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(
        jax.shard_map(local_step, mesh=mesh, in_specs=(P(), specs, P(AXIS)), out_specs=(P(), specs))
    )
    return specs, init, step


def batch(mesh, rank, i):
    x = np.random.RandomState(1000 * rank + i).normal(size=(4 * mesh.size, 64))
    return jax.device_put(x.astype(np.float32), NamedSharding(mesh, P(AXIS)))


def target(shapes, mesh):
    """``jax.eval_shape``'s structure with shardings on ``mesh``, for ``restore``."""
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=NamedSharding(mesh, a.sharding.spec)
        ),
        shapes,
    )


def device_bits(tree):
    """Per leaf, ``(device id, bytes)`` of every addressable shard."""
    return [
        sorted((s.device.id, np.asarray(s.data).tobytes()) for s in a.addressable_shards)
        for a in jax.tree.leaves(tree)
    ]


def _digest(chunks) -> str:
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    return h.hexdigest()


def roundtrip(name: str, mesh, rank: int, directory: Path) -> dict:
    """Train, save to ``directory/rank{rank}/name``, restore, step on; what matched."""
    tx = optax.chain(CASES[name](), optax.sgd(0.05, momentum=0.9))
    specs, init, step = training(tx, mesh)
    params = jax.device_put(_params(), NamedSharding(mesh, P()))
    state = init(params)
    for i in range(STEPS):
        params, state = step(params, state, batch(mesh, rank, i))
    live = (params, state)
    path = Path(directory) / f"rank{rank}" / name
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, live)
    shapes = jax.eval_shape(lambda p: (p, init(p)), params)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(path, target(shapes, mesh))
    x = batch(mesh, rank, STEPS)
    all_specs = (jax.tree.map(lambda _: P(), params), specs)
    leaf_specs = jax.tree.leaves(all_specs, is_leaf=lambda s: isinstance(s, P))
    assert len(leaf_specs) == len(jax.tree.leaves(live))
    per_replica = [a for a, s in zip(jax.tree.leaves(live), leaf_specs) if s == P(AXIS)]
    return {
        "structure": jax.tree.structure(restored) == jax.tree.structure(live),
        "shardings": all(
            a.sharding == b.sharding
            for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(live))
        ),
        "bits": device_bits(restored) == device_bits(live),
        "next_step": device_bits(step(*restored, x)) == device_bits(step(*live, x)),
        "per_replica_leaves": len(per_replica),
        # Each device's residual differs from the others' (its own shard of the data),
        # so the per-device comparison above tells them apart.
        "replicas_differ": all(len({b for _, b in bits}) > 1 for bits in device_bits(per_replica)),
        "per_replica_digest": _digest(b for bits in device_bits(per_replica) for _, b in bits),
        # The parameters, synchronised (the states' owner fields, P() too, are the rank).
        "params_digest": _digest(np.asarray(a).tobytes() for a in jax.tree.leaves(params)),
    }


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), (AXIS,))


@pytest.mark.filterwarnings(NO_INTER_PROCESS)
@pytest.mark.parametrize("name", list(CASES))
def test_every_state_restores_bit_for_bit(name, mesh, tmp_path):
    r = roundtrip(name, mesh, 0, tmp_path)
    assert r["structure"] and r["shardings"] and r["bits"] and r["next_step"], r
    assert r["per_replica_leaves"] == PER_REPLICA[name], r
    assert r["replicas_differ"], r
    assert (tmp_path / "rank0" / name / "commit_success.txt").exists()


def test_the_checks_see_a_misplaced_residual_and_a_missing_target(mesh, tmp_path):
    # Restored onto the devices in reverse order, every value is right but each
    # device holds another's residual: the per-device comparison fails. Restored
    # without a target, orbax returns plain containers, not the state's types.
    tx = optax.chain(CASES["powersgd_mean"](), optax.sgd(0.05, momentum=0.9))
    specs, init, step = training(tx, mesh)
    params = jax.device_put(_params(), NamedSharding(mesh, P()))
    state = init(params)
    params, state = step(params, state, batch(mesh, 0, 0))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", state)
    shapes = jax.eval_shape(init, params)
    reversed_mesh = jax.sharding.Mesh(np.array(mesh.devices)[::-1], (AXIS,))
    with ocp.StandardCheckpointer() as checkpointer:
        right = checkpointer.restore(tmp_path / "ckpt", target(shapes, mesh))
        swapped = checkpointer.restore(tmp_path / "ckpt", target(shapes, reversed_mesh))
        bare = checkpointer.restore(tmp_path / "ckpt")
    assert device_bits(right) == device_bits(state)
    assert device_bits(swapped) != device_bits(state)
    assert all(
        np.array_equal(a, b) for a, b in zip(jax.tree.leaves(swapped), jax.tree.leaves(state))
    )
    assert jax.tree.structure(bare) != jax.tree.structure(state)


def _save_parts(directory, parts):
    for q, part in enumerate(parts):
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(directory / f"rank{q}", part.inner)


def _loader(directory, inner, params, replicas, processes, loaded):
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def load(q):
        loaded.append(q)
        shapes = jaxsync.state_shapes(
            inner, params, replicas=replicas, process=q, processes=processes
        )
        target = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), shapes.inner
        )
        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore(directory / f"rank{q}", target)

    return load


@pytest.mark.filterwarnings(NO_INTER_PROCESS)
def test_a_sharded_state_restores_on_other_world_sizes_from_the_parts(mesh, tmp_path):
    # A sharded(adam) state trained on 8 replicas, saved as the parts of 2 processes
    # of 4 devices, restores as the parts of 1 process x 8, 3 x 1 and 4 x 2,
    # bitwise those shard_state cuts from the whole, each rank loading only the saved
    # parts that overlap its own; and back from 3 processes' parts to 2.
    inner = optax.adam(0.05)
    with jax.numpy_dtype_promotion("standard"):  # adam's bias correction
        _, init, step = training(jaxsync.sharded(inner, axis_name=AXIS, comm=None), mesh)
        params = jax.device_put(_params(), NamedSharding(mesh, P()))
        state = init(params)
        for i in range(2):
            params, state = step(params, state, batch(mesh, 0, i))
    whole = jaxsync.gather_state(inner, jax.device_get(state), _params())
    assert jax.tree.structure(whole) == jax.tree.structure(inner.init(_params()))

    def parts(replicas, processes):
        return [
            jaxsync.shard_state(
                inner, whole, _params(), replicas=replicas, process=q, processes=processes
            )
            for q in range(processes)
        ]

    def check(saved, new):  # (replicas, processes) each
        directory = tmp_path / f"{saved}-{new}"
        _save_parts(directory, parts(*saved))
        for q, want in enumerate(parts(*new)):
            loaded: list = []
            load = _loader(directory, inner, _params(), *saved, loaded)
            got = jaxsync.reshard_state(
                inner, _params(), load, saved_replicas=saved[0], saved_processes=saved[1],
                replicas=new[0], process=q, processes=new[1],
            )  # fmt: skip
            assert device_bits(got.inner) == device_bits(want.inner), (saved, new, q)
            assert got.per_replica == want.per_replica
            yield q, loaded

    assert dict(check((8, 2), (8, 1))) == {0: [0, 1]}
    # w: 2048 elements, b: 32; 3 replicas -> 683 and 11 a slice: rank 1 spans both parts
    assert dict(check((8, 2), (3, 3))) == {0: [0], 1: [0, 1], 2: [1]}
    assert dict(check((8, 2), (8, 4))) == {0: [0], 1: [0], 2: [1], 3: [1]}
    assert dict(check((3, 3), (4, 2))) == {0: [0, 1], 1: [1, 2]}
    assert all(np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(whole), jax.tree.leaves(jaxsync.gather_state(inner, parts(3, 3), _params()))
    ))  # fmt: skip

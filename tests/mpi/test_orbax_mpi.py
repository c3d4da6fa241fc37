"""Orbax checkpoints of every jaxsync state under ``mpirun -n 2`` x 2 devices
(worker_orbax.py, tests/test_orbax.py's round trip on each rank).

Both ranks are process 0 to orbax; each saves into its own directory and restores
from it: bit-identical states and the same next step on every rank, each rank's
per-replica leaves its own (they differ between the ranks), the parameters the
same on both.
"""

from __future__ import annotations

import pytest
from mpi_harness import requires_mpi, run_mpi
from test_orbax import CASES, PER_REPLICA

pytestmark = requires_mpi


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("orbax")
    return run_mpi("worker_orbax.py", n=2, devices=2, args=("--ckpt", ckpt), timeout=300)


def test_every_state_restores_on_every_rank(ranks):
    r0, r1 = ranks.check().results
    assert [r["rank_size"] for r in (r0, r1)] == [(0, 2, 0), (1, 2, 0)]  # orbax: process 0
    assert r0["dirs"] == r1["dirs"] == ["rank0", "rank1"]
    assert r0["mine"] == r1["mine"] == sorted(CASES)
    for name in CASES:
        a, b = r0["cases"][name], r1["cases"][name]
        for r in (a, b):
            assert r["structure"] and r["shardings"] and r["bits"] and r["next_step"], (name, r)
            assert r["per_replica_leaves"] == PER_REPLICA[name] and r["replicas_differ"], name
        assert a["params_digest"] == b["params_digest"], name  # synchronised
        if PER_REPLICA[name]:  # each rank's residuals (or pending gradients) its own
            assert a["per_replica_digest"] != b["per_replica_digest"], name


def test_a_sharded_checkpoint_restores_on_another_world_size(tmp_path):
    """jaxsync.sharded saved by 2 ranks x 2 devices restores on 1 process x 2
    devices, and the reverse: each rank writes its own part (orbax: process 0
    everywhere), a barrier, and each rank of the other world restores its part
    from the saved ranks whose slices overlap it (``reshard_state``): the
    chain's state cut for that world, bit for bit, and the same next step as
    the chain. ``gather_state(comm=...)``: the whole state on rank 0 only."""
    r0, r1 = (
        run_mpi("worker_zero_ckpt.py", n=2, devices=2, args=("--ckpt", tmp_path), timeout=300)
        .check()
        .results
    )
    assert r0["whole_on_root"] is True and r1["whole_on_root"] is None
    assert r0["a_to_b"] == {"state": True, "loaded": [0, 1]}
    assert r0["a_to_b_step"] == (True, False)  # the chain's step, and a step taken
    assert r0["dirs"] == ["rank0", "rank1", "world.json"]
    for r in (r0, r1):
        assert r["b_to_a"] == {"state": True, "loaded": [0]}
        assert r["b_to_a_step"] == (True, False)

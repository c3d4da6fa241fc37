"""powersgd_mean and sign_mean across processes: mpirun -n 2 x 2 devices.

Worker: tests/mpi/worker_compress.py (50 steps of a small MLP under
jit(shard_map), state passed with jaxsync.state_specs; a checkpoint round trip
through numpy.savez halfway).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi_harness import requires_mpi, run_mpi

pytestmark = requires_mpi

DEVICES = 2
NAMES = ("powersgd", "sign")


@pytest.fixture(scope="module")
def compress_run():
    return run_mpi("worker_compress.py", n=2, devices=DEVICES, timeout=240).check()


def _get(run, rank, key):
    res = run.results[rank]
    name = key.split(":")[0]
    if f"{name}:error" in res:
        pytest.fail(f"rank {rank} {name}:\n{res[f'{name}:error']}", pytrace=False)
    return res[key]


def _u(a):
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.itemsize])


@pytest.mark.parametrize("name", NAMES)
def test_replicas_bit_identical_after_50_steps(compress_run, name):
    own = [_get(compress_run, r, f"{name}:own") for r in range(2)]
    for leaf in own[0]:
        every = np.concatenate([own[0][leaf], own[1][leaf]])  # 4 replicas
        assert every.shape[0] == 2 * DEVICES
        assert (_u(every) == _u(every[:1])).all(), f"{name} {leaf}: replicas differ"
    for r in range(2):  # each rank's local loss (its own data) goes down
        losses = _get(compress_run, r, f"{name}:losses")
        assert len(losses) == 50 and losses[-1] < 0.5 * losses[0], losses[::10]


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_round_trip_bit_identical(compress_run, name):
    for r in range(2):
        own, resumed = (_get(compress_run, r, f"{name}:{k}") for k in ("own", "resumed_own"))
        for leaf in own:
            assert (_u(own[leaf]) == _u(resumed[leaf])).all(), (r, name, leaf)
        state, rstate = (_get(compress_run, r, f"{name}:{k}") for k in ("state", "resumed_state"))
        assert len(state) == len(rstate)
        for a, b in zip(state, rstate):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert (_u(a) == _u(b)).all() if a.dtype.kind == "f" else (a == b).all()


def test_residuals_are_per_replica(compress_run):
    """The error feedback is each replica's own: residuals differ across ranks."""
    for name in NAMES:
        s0, s1 = (_get(compress_run, r, f"{name}:state") for r in range(2))
        big = [i for i, a in enumerate(s0) if a.ndim >= 2 and a.shape[0] >= 2 * 12]
        assert any(not np.array_equal(s0[i], s1[i]) for i in big), name


def test_sign_bits_travel_as_uint8_through_the_native_allgather(compress_run):
    assert _get(compress_run, 0, "sign:native_allgather_u8") is True


@pytest.mark.parametrize("name", NAMES)
def test_default_step_has_no_host_callback(compress_run, name):
    assert _get(compress_run, 0, f"{name}:callbacks") == 0

"""powersgd_mean and sign_mean across processes: mpirun -n 2 x 2 devices.

Worker: tests/mpi/worker_compress.py (50 steps of a small MLP under
jit(shard_map), state passed with jaxsync.state_specs; a checkpoint round trip
through numpy.savez halfway).
"""

from __future__ import annotations

import jax
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


# --------------------------------------------------------------------------
# Issue 27: host staging with a bound axis; rank 0's checkpoint on every rank
# (worker_compress.py --mode review; integer-valued gradients, exact)


@pytest.fixture(scope="module", params=[1, 2], ids=["1dev", "2dev"])
def review_run(request):
    return run_mpi(
        "worker_compress.py", n=2, devices=request.param, args=("--mode", "review"), timeout=180
    ).check()


def test_sign_host_staging_under_shard_map(review_run):
    """staging="host" (leader in lax.cond) with axis_name bound, 1 or 2 devices."""
    devices = review_run.results[0]["meta"]["devices"]
    n = 2 * devices  # replica r sends w = (r + 1) * pattern: scale 2 (r + 1)
    pattern = np.array([1, -3, 2, -2, 3, -1, 2, -2], np.float32)
    want_w = ((n + 1) * np.sign(pattern)).astype(np.float32)  # mean of 2 (r + 1) sign
    want_b = np.full(2, (n - 1) / 2, np.float32)  # exact mean of r
    for r in range(2):
        host, device = (_get(review_run, r, f"{s}:outs") for s in ("host", "device"))
        first = host[0]
        assert (_u(first["w"]) == _u(np.broadcast_to(want_w, first["w"].shape))).all()
        assert (_u(first["b"]) == _u(np.broadcast_to(want_b, first["b"].shape))).all()
        for h, d in zip(host, device):  # every step, bit for bit
            for leaf in ("w", "b"):
                assert (_u(h[leaf]) == _u(d[leaf])).all(), (r, leaf)
        hres, dres = (_get(review_run, r, f"{s}:residual") for s in ("host", "device"))
        assert (_u(hres) == _u(dres)).all()
        # every leaf compressed (b too: b_r = r, scale r, sent exactly): the same mean
        first = _get(review_run, r, "host_all:outs")[0]
        assert (_u(first["w"]) == _u(np.broadcast_to(want_w, first["w"].shape))).all()
        assert (_u(first["b"]) == _u(np.broadcast_to(want_b, first["b"].shape))).all()


def test_rank0_checkpoint_on_every_rank_drops_the_foreign_residuals(review_run):
    """Every rank restores rank 0's file: rank 0 continues as with its own state,
    the others as with zero residuals (never rank 0's error on their gradients)."""
    own = [_get(review_run, r, "restore:own_residual") for r in range(2)]
    assert not np.array_equal(own[0], own[1]) and np.any(own[1] != 0)  # can fail
    for r in range(2):
        restored, zeroed = (_get(review_run, r, f"restore:{k}") for k in ("restored", "zeroed"))
        a, b = jax.tree.leaves(restored), jax.tree.leaves(zeroed)
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert x.shape == y.shape and (_u(x) == _u(y)).all(), r
        assert int(_get(review_run, r, "restore:owner")) == r

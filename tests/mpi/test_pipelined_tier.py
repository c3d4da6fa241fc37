"""The pipelined host tier (one ``jaxsync_tier`` call, its stages at once over
chunks) under mpirun: processes faked into hosts of 2 (tests/mpi/worker_pipelined_tier.py).

Exact for integer-valued data and bitwise equal to the tier's three calls, with
chunk boundaries inside a leaf, a leaf smaller than a chunk and an empty leaf,
mean and sum, float32 and bfloat16 on the wire: 2 hosts x 2 processes with 1
and 2 devices each, and 3 hosts (16-bit sums across them: all-to-all, float32
in host order, all-gather).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from mpi_harness import requires_mpi, run_mpi
from worker_pipelined_tier import CASES, SIZES, value

pytestmark = requires_mpi

BF16 = ml_dtypes.bfloat16


def _f32_sum(xs) -> np.ndarray:
    """float32 sum of ``xs`` in order, rounded once to bfloat16."""
    acc = np.zeros_like(xs[0], dtype=np.float32)
    for x in xs:
        acc = acc + x.astype(np.float32)
    return acc.astype(BF16)


def _bf16_tier(devices: int, n: int, hosts: int) -> np.ndarray:
    """The tier's roundings of bfloat16 sums: each process's devices, each host's
    (2) processes, the hosts, each summed in float32 and rounded once."""
    reps = lambda p: [value(np, p * devices + d, n).astype(BF16) for d in range(devices)]
    proc = [_f32_sum(reps(p)) for p in range(2 * hosts)]
    host = [_f32_sum(proc[2 * h : 2 * h + 2]) for h in range(hosts)]
    return _f32_sum(host).astype(np.float32)


@pytest.fixture(
    scope="module", params=[(2, 1), (2, 2), (3, 1)], ids=["2x2-1dev", "2x2-2dev", "3x2-1dev"]
)
def tier_run(request):
    hosts, devices = request.param
    args = ("--hosts", str(hosts))
    run = run_mpi("worker_pipelined_tier.py", n=2 * hosts, devices=devices, args=args, timeout=240)
    return hosts, devices, run.check()


@pytest.mark.parametrize("case", ["-".join(c) for c in CASES])
def test_pipelined_tier_is_one_call_and_bitwise_the_three_calls(tier_run, case):
    hosts, devices, run = tier_run
    _, reduce, dtype = case.split("-")
    total = 2 * hosts * devices
    for rank, res in enumerate(run.results):
        assert "jaxsync_tier" in res[f"{case}:pipelined:calls"], res[f"{case}:pipelined:calls"]
        assert "jaxsync_tier" not in res[f"{case}:calls:calls"], res[f"{case}:calls:calls"]
        if dtype == "f32" or hosts == 2:  # the hosts' allreduce, in 12-byte pieces
            assert "12" in res[f"{case}:calls:pieces"], res[f"{case}:calls:pieces"]
        new, old = res[f"{case}:pipelined"], res[f"{case}:calls"]
        for leaf, n in SIZES.items():
            got = new[leaf]
            assert got.shape == (devices, n), (case, leaf, got.shape)
            assert np.array_equal(got.view(np.uint32), old[leaf].view(np.uint32)), (
                rank,
                case,
                leaf,
            )
            if reduce != "sum":
                continue
            if dtype == "f32":
                want = np.sum([value(np, r, n) for r in range(total)], axis=0)
            else:
                want = _bf16_tier(devices, n, hosts)
            for d in range(devices):
                np.testing.assert_array_equal(got[d], want, err_msg=f"rank {rank} {case} {leaf}")


def test_a_tree_of_one_chunks_bytes_keeps_the_three_calls(tier_run):
    hosts, devices, run = tier_run
    want = np.sum([value(np, r, SIZES["b"]) for r in range(2 * hosts * devices)], axis=0)
    for res in run.results:
        assert "jaxsync_tier" not in res["small:calls"], res["small:calls"]
        assert "jaxsync_reduce" in res["small:calls"], res["small:calls"]
        for d in range(devices):
            np.testing.assert_array_equal(res["small"][d], want)


def test_the_timeline_names_the_pipelined_call(tier_run):
    # one event of kind "tier" per call (it was recorded as a "reduce"), on the
    # host's communicator, with the whole buffer's bytes; none of the three calls
    hosts, devices, run = tier_run
    nbytes = 4 * sum(SIZES.values())  # float32
    for rank, res in enumerate(run.results):
        names = {name for name, *_ in res["timeline"]} - {"agree"}
        assert names == {"tier"}, (rank, res["timeline"])
        for name, comm, got, call in res["timeline"]:
            if name == "tier":
                assert comm.startswith("host, device") and got == nbytes and call == 0, (
                    rank,
                    res["timeline"],
                )

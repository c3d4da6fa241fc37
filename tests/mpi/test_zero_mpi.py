"""jaxsync.sharded under mpirun: 2 and 3 processes, 1 and 2 devices each
(``worker_zero.py``): the parameters after 20 steps equal the chain's bit for
bit (``reduce="sum"``, power-of-two hyperparameters) and within a tolerance
for optax.adam's defaults with the mean; every rank holds the same
parameters; the gathered state equals the chain's, and cutting it again gives
each rank its own state back."""

from __future__ import annotations

import numpy as np
import pytest
from mpi_harness import requires_mpi, run_mpi

pytestmark = requires_mpi

ALL = "sgd,momentum,adamw,lion,clip"
# 3 processes of 1 device: the uneven split without packing (each process's leaves
# as they are), with the inners whose state differs in kind (none, per element
# with a mask, a global norm); the others run with 2 processes and on 3 x 2.
CONFIGS = [(2, 1, ALL), (2, 2, ALL), (3, 1, "sgd,adamw,clip"), (3, 2, ALL)]


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: f"{c[0]}procs-{c[1]}dev")
def zero_run(request):
    n, devices, cases = request.param
    run = run_mpi("worker_zero.py", n=n, devices=devices, args=("--cases", cases), timeout=420)
    assert run.returncode == 0 and not run.timed_out, run.output[-3000:]
    run.cases = set(cases.split(","))
    return run


def _bits(a):
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def _equal(got, want, what):
    assert sorted(got) == sorted(want), what
    for k in got:
        np.testing.assert_array_equal(_bits(got[k]), _bits(want[k]), err_msg=f"{what} {k}")


def _leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def test_sharded_equals_the_chain_across_processes(zero_run):
    _check_run(zero_run.results, zero_run.cases)


def test_gathered_state_is_the_chains_and_reshards_to_each_rank(zero_run):
    _check_states(zero_run.results)


def _check_run(results, cases):
    """Every rank: the chain's parameters, bit for bit, and rank 0's."""
    keys = [k for k in results[0] if k.count(":") == 1 and not k.endswith("adam_mean")]
    assert {k.split(":")[1] for k in keys} >= cases
    for rank, res in enumerate(results):
        for key in keys:
            got, want = res[key]
            _equal(got, want, f"rank {rank} {key}")
            _equal(got, results[0][key][0], f"rank {rank} vs rank 0 {key}")
            assert not np.array_equal(got["w"], np.ones((3, 5))), key
        for key in [k for k in res if k.endswith("adam_mean")]:
            got, want = res[key]
            for k in got:
                np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=key)


def _check_states(results):
    for rank, res in enumerate(results):
        for key in [k for k in res if k.endswith(":state")]:
            whole, chained = res[key]
            for a, b in zip(_leaves(whole), _leaves(chained)):
                np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"{rank} {key}")
        for key in [k for k in res if k.endswith(":reshard")]:
            mine, local = res[key]
            for a, b in zip(_leaves(mine), _leaves(local)):
                np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"{rank} {key}")


def test_the_donated_step_copies_no_state_and_host_staging(zero_run):
    """With one device per process, the compiled step with params and state
    donated has no copy: the state is updated where it is (a reshape between
    the inner state and the stored one once made XLA copy all of it in); the
    gradients are reduce-scattered in place and the updates gathered as they
    are, in one call, with no concatenate (a result buffer and a packed buffer of their
    own put a 22 MB tree's step temporaries past glibc's 32 MiB mmap ceiling:
    every page faulted in afresh each step, 2.2x the chain's step). And
    ``staging="host"`` (float32 and bfloat16 on the wire) equals the chain."""
    if zero_run.results[0]["meta"]["devices"] != 1:
        pytest.skip("checked with one device per process")
    for rank, res in enumerate(zero_run.results):
        assert res["copies"] == 0, res["copies"]
        assert res["rs_in_place"] == [True], res["rs_in_place"]
        assert res["concatenates"] == 0, res["concatenates"]
        for key in ("host:f32", "host:bf16"):  # staging="host", and 16-bit on the wire
            got, want = res[key]
            _equal(got, want, f"rank {rank} {key}")


def test_native_calls_a_step_are_the_chains_plus_a_constant(zero_run):
    """On a transformer-like tree of 26 small leaves (the timeline's count of
    native calls a step): sharded(adam) made one all-gather per leaf (26, the
    chain's step 1 call); now its updates are gathered in one call per bucket
    (the chain's bucket_bytes). With 2 devices each device's communicator makes
    its own reduce-scatter and all-gather of the packed slices (one per dtype)."""
    for rank, res in enumerate(zero_run.results):
        calls, dev = res["calls"], res["meta"]["devices"]
        assert calls["leaves"] == 26
        sharded, chain = sum(calls["sharded"].values()), sum(calls["chain"].values())
        assert chain >= 1 and sharded <= chain + 2 * dev, (rank, calls)
        assert calls["sharded"].get("allgather", 0) == dev, (rank, calls)


@pytest.mark.parametrize("hosts,agree", [("2", "once"), ("1", "once"), ("2", "run")])
def test_blocking_calls_across_hosts_poll_instead_of_spinning(hosts, agree):
    """Across hosts (two processes faked as two hosts) the blocking native calls
    (sharded's reduce-scatter and all-gathers, a blocking allreduce) test and
    sleep while a late peer keeps them waiting: rank 0's process used a fraction
    of a core over the wait (they spun: a whole core, sharded's step 99% CPU busy
    on the emulated cluster at 1 Gb/s, the chain's polled sum 21-32%). Within a
    host they spin (poll_us 0: shared-memory copies need the CPU). A polled wait
    gives the core away between tests in its first millisecond (it spun: with
    more processes a host than cores the peer it waits for may need that core),
    then sleeps. The results are the chain's.

    With the agreement header exchanged on every run (the default), the late
    peer is waited for in the header's exchange, which polls too (a fraction of
    a core) and leaves the data calls' counts alone; ``JAXSYNC_AGREE=once``
    shows the data calls' own polled waits. (Run with the header on every run,
    the old form of this test counted 0 sleeps: the wait had moved there.)"""
    got = run_mpi(
        "worker_poll.py", n=2, devices=1, args=("--hosts", hosts, "--agree", agree), timeout=240
    ).check()
    r0 = got.results[0]
    for name in ("sharded", "blocking"):
        want = ["100"] if hosts == "2" else ["0"]
        assert r0[f"{name}:poll"] == want, (name, r0[f"{name}:poll"])
        yields, sleeps = r0[f"{name}:yields_sleeps"]
        if hosts == "2":
            assert r0[f"{name}:cpu_over_wall"] < 0.25, (name, r0[f"{name}:cpu_over_wall"])
            if agree == "once":
                assert yields > 0 and sleeps > 0, (name, yields, sleeps)
        else:  # MPI's own blocking calls
            assert (yields, sleeps) == (0, 0), (name, yields, sleeps)
    for r in got.results:
        _equal(r["sharded:result"], r["blocking:result"], "sharded against the chain")

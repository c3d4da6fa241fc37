"""jaxsync.local under mpirun (``worker_local.py``): 2 processes of 2 devices,
islands="process"; shard_map over both devices and plain jit on one. Against
float64 references written out, bitwise (dyadic values): H=1 with outer sgd(1)
is data-parallel sgd, DiLoCo with outer momentum, BMUF (Caffe2's recurrence);
within a bound: a bfloat16 wire. A non-finite island skips the outer step on
both; an inner mean over the world and a disagreement on ``every`` give an
error on every rank (no hang)."""

from __future__ import annotations

import numpy as np
import pytest
from mpi_harness import requires_mpi, run_mpi

pytestmark = requires_mpi

C = np.array([[3.0, -5.0], [1.0, 7.0], [-2.0, 4.0], [6.0, 0.0]])
X0 = np.array([4.0, -2.0])


# Each case on jaxsync's native path and on the GPU path (mpi4jax's targets, the
# outer mean's lax.cond ordered by data: _ordering.chain_after) taken on CPU
# through mpi4jax's CPU bridge, where overlap=True is refused.
@pytest.fixture(scope="module", params=["native", "mpi4jax"])
def local_run(request):
    env = {"JAXSYNC_TESTING_MPI4JAX": "1"} if request.param == "mpi4jax" else None
    run = run_mpi("worker_local.py", n=2, devices=2, timeout=300, env=env)
    assert run.returncode == 0 and not run.timed_out, run.output[-3000:]
    run.path = request.param
    return run


def targets(mode):
    """Each island's target: the mean of its devices' (smap), or its first device's."""
    if mode == "smap":
        return [C[0:2].mean(axis=0), C[2:4].mean(axis=0)]
    return [C[0], C[2]]


def reference(mode, steps, every, outer, warmup=0):
    """Parameters and anchor after each step; ``outer(pg, state) -> (anchor, state)``;
    ``warmup`` steps of data parallel first (the gradients averaged over both)."""
    cs = targets(mode)
    xs, anchor, state, out = [X0.copy(), X0.copy()], X0.copy(), None, []
    for t in range(1, steps + 1):
        if t <= warmup:
            xs = [x - 0.5 * (x - np.mean(cs, axis=0)) for x in xs]
            anchor = xs[0].copy()
            out.append((xs, anchor.copy()))
            continue
        xs = [x - 0.5 * (x - c) for x, c in zip(xs, cs)]
        if (t - warmup) % every == 0:
            pg = np.mean([anchor - x for x in xs], axis=0)
            anchor, state = outer(anchor, pg, state)
            xs = [anchor.copy(), anchor.copy()]
        out.append((xs, anchor.copy()))
    return out


def sgd(lr, mu=0.0):
    def outer(anchor, pg, m):
        m = pg if m is None else mu * m + pg
        return anchor - lr * m, m

    return outer


def bmuf(eta, zeta=1.0):
    def outer(anchor, pg, v):  # Caffe2: v <- eta v + zeta (avg - theta_g); theta_g += v
        v = np.zeros(2) if v is None else v
        v = eta * v + zeta * ((anchor - pg) - anchor)
        return anchor + v, v

    return outer


CASES = {"dp": (3, 1, sgd(1.0)), "diloco": (6, 2, sgd(0.5, 0.5)), "bmuf": (6, 2, bmuf(0.5))}


@pytest.mark.parametrize("mode", ["smap", "jit"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_closed_forms_across_processes(local_run, mode, case):
    steps, every, outer = CASES[case]
    want = reference(mode, steps, every, outer)
    for rank, res in enumerate(local_run.results):
        got = res[f"{mode}:{case}"]
        for t, ((x, a, skipped), (xs, anchor)) in enumerate(zip(got, want)):
            np.testing.assert_array_equal(x, xs[rank], err_msg=f"rank {rank} step {t}")
            np.testing.assert_array_equal(a, anchor, err_msg=f"rank {rank} step {t}")
            assert skipped == 0


def test_the_watchdog_leaves_every_stage_it_enters(local_run):
    """With timeout= under shard_map: the same parameters as without, and no
    stage left open after a step. The configuration's agreement used to stay
    entered (a stall reported after ``timeout`` seconds, or the job ended with
    on_timeout="abort") and to type the step count varying over the devices
    (shard_map refused the state's out_specs)."""
    for res in local_run.results:
        for got, want in zip(res["watched"], res["smap:diloco"][:3], strict=True):
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w)
        assert res["watched:open"] and not any(res["watched:open"]), res["watched:open"]


def test_post_local_sgd_warmup_is_data_parallel_first(local_run):
    want = reference("smap", 6, 2, sgd(1.0), warmup=2)
    for rank, res in enumerate(local_run.results):
        for t, ((x, a, _), (xs, anchor)) in enumerate(zip(res["warmup"], want)):
            np.testing.assert_array_equal(x, xs[rank], err_msg=f"rank {rank} step {t}")
            np.testing.assert_array_equal(a, anchor, err_msg=f"rank {rank} step {t}")


@pytest.mark.parametrize("wire", ["", ":bf16"])
def test_the_mean_in_flight_across_steps_equals_the_held_mean(local_run, wire):
    for res in local_run.results:
        held, flying = res["stream:False" + wire], res["stream:True" + wire]
        if local_run.path == "mpi4jax":  # refused, naming the held form
            kind, msg = flying
            assert kind == "ValueError" and "overlap=False" in msg and "CPU only" in msg, flying
            assert len(held) == 9 and not np.array_equal(held[-1][1], X0)
            continue
        assert len(held) == 9
        for t, ((x, a, _), (y, b, _)) in enumerate(zip(held, flying)):
            np.testing.assert_array_equal(x, y, err_msg=f"step {t}")
            np.testing.assert_array_equal(a, b, err_msg=f"step {t}")
        assert not np.array_equal(held[-1][1], X0)  # the anchor moved


def test_bfloat16_wire_within_its_rounding(local_run):
    def nesterov(anchor, pg, m):
        m = pg if m is None else 0.9 * m + pg
        return anchor - 0.7 * (pg + 0.9 * m), m

    want = reference("smap", 4, 2, nesterov)
    for res in local_run.results:
        for (_x, a, _), (_, anchor) in zip(res["bf16"], want):
            # DiLoCo's default outer; each pseudo-gradient (|pg| < 4) is rounded once
            # to bfloat16 (2^-8 relative) on the wire, times lr (1 + mu) < 2
            np.testing.assert_allclose(a, anchor, rtol=0, atol=2.0**-8 * 8)


def test_a_nonfinite_island_skips_the_outer_step_on_both(local_run):
    r0, r1 = (res["skip"] for res in local_run.results)
    for rows in (r0, r1):
        np.testing.assert_array_equal(rows[3][1], rows[1][1])  # anchor kept
        np.testing.assert_array_equal(rows[3][0], rows[1][1])  # params back to it
        assert [s for _, _, s in rows] == [0, 0, 0, 1]
    np.testing.assert_array_equal(r0[3][1], r1[3][1])


def test_an_island_nan_between_outer_steps_goes_back_to_the_anchor_on_both(local_run):
    r0, r1 = (res["nan-inner"] for res in local_run.results)
    for rows in (r0, r1):
        assert all(np.isfinite(x).all() for x, _, _ in rows)
        np.testing.assert_array_equal(rows[3][0], X0)  # the (kept) anchor
        np.testing.assert_array_equal(rows[3][1], X0)
        assert [s for _, _, s in rows] == [0, 0, 0, 1, 1, 1]
    np.testing.assert_array_equal(r1[1][0], r1[0][0])  # rank 1 idles after its NaN
    assert not np.array_equal(r0[5][0], r1[5][0])  # both train again, apart


def test_islands_whose_anchors_differ_fail_alike(local_run):
    got = [res["anchors"] for res in local_run.results]
    assert got[0] == got[1], got
    kind, msg = got[0]
    assert kind != "OK" and "anchors differ at the first outer step (step 2)" in msg, got


def test_host_islands_on_one_machine_are_one_island_of_both(local_run):
    # Lookahead with the two processes' mean as the inner step: x runs to the
    # mean target; every 2 steps anchor <- anchor + 0.5 (x - anchor), x <- anchor.
    target = (C[0] + C[2]) / 2
    x, anchor, want = X0.copy(), X0.copy(), []
    for t in range(1, 5):
        x = x - 0.5 * (x - target)
        if t % 2 == 0:
            anchor = anchor - 0.5 * (anchor - x)
            x = anchor.copy()
        want.append((x.copy(), anchor.copy()))
    for res in local_run.results:
        assert res["host:islands"] == (1, 2, True)
        for (x, a, _), (wx, wa) in zip(res["host"], want):
            np.testing.assert_array_equal(x, wx)
            np.testing.assert_array_equal(a, wa)


def test_an_inner_mean_over_the_world_is_refused_on_every_rank(local_run):
    for res in local_run.results:
        kind, msg = res["guard"]
        assert kind == "ValueError" and "beyond the island" in msg and "isl.comm" in msg, msg


def test_islands_that_disagree_on_every_fail_alike(local_run):
    got = [res["disagree"] for res in local_run.results]
    assert all(kind != "OK" for kind, _ in got), got
    assert got[0] == got[1], got
    assert "every 2" in got[0][1] and "every 4" in got[0][1], got[0][1]


@pytest.fixture(scope="module")
def sliced_run():
    """4 processes, 2 islands of 2 (worker_local_sliced.py)."""
    run = run_mpi("worker_local_sliced.py", n=4, devices=1, timeout=240)
    assert run.returncode == 0 and not run.timed_out, run.output[-3000:]
    return run


def test_a_sliced_anchor_across_processes_gives_the_same_parameters(sliced_run):
    """Each process keeps half of the anchor (x: 3 of 5 elements, padded; y: 2 of
    3), bitwise the parameters of the whole anchor, DiLoCo and streaming
    (fragments, delay, mix)."""
    check_sliced(sliced_run.results)


def test_processes_of_one_island_that_disagree_fail_alike(sliced_run):
    """Rank 1 alone has another ``every``: its outer communicator is {1, 3}, yet
    every rank gets the same error (the agreement spans the world): none waits
    in the inner mean for a peer that failed."""
    check_disagreement(sliced_run.results)


def check_disagreement(results):
    """Every rank's record of worker_local_sliced.py's last case: one error."""
    got = [res["disagree"] for res in results]
    assert all(kind != "OK" for kind, _ in got), got
    assert got.count(got[0]) == 4, got
    msg = got[0][1]
    assert "configuration differs between rank 0 and rank 1 (every)" in msg, msg
    assert "every 2" in msg and "every 4" in msg, msg


def check_sliced(results):
    """The sliced anchor's parameters, and streaming's mean in flight, bitwise
    the whole anchor's held form (worker_local_sliced.py's records)."""
    for rank, res in enumerate(results):
        assert res["islands"] == [2, rank // 2], res["islands"]
        for t, (a, b) in enumerate(zip(res["streaming:False"], res["streaming:overlap"])):
            for k in ("x", "y"):
                np.testing.assert_array_equal(b[k], a[k], err_msg=f"in flight, step {t} {k}")
        for name in ("diloco", "streaming"):
            whole, sliced = res[f"{name}:False"], res[f"{name}:True"]
            assert res[f"{name}:True:anchor"] == {"x": [3], "y": [2]}
            assert res[f"{name}:False:anchor"] == {"x": [5], "y": [3]}
            for t, (a, b) in enumerate(zip(whole, sliced)):
                for k in ("x", "y"):
                    np.testing.assert_array_equal(b[k], a[k], err_msg=f"{name} step {t} {k}")
            assert not np.array_equal(whole[-1]["x"], np.full(5, 4.0))

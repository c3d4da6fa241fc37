"""ULFM in the ft environment (scripts/setup_ft.sh): a killed rank, survivors recover.

Needs the second virtual environment with Open MPI 5's wheel ($JAXSYNC_FT_VENV, default
.venv-ft in the checkout); without it the tests are skipped, naming it, except in CI
(``CI=true``), where they fail: scripts/test.sh builds it first (``bash
scripts/setup_ft.sh``: 37-66 s here with a warm pip cache, half of it compiling the
native target).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _harness import in_ci
from mpi_harness import run_command

ROOT = Path(__file__).resolve().parents[2]
FT_VENV = Path(os.environ.get("JAXSYNC_FT_VENV") or ROOT / ".venv-ft")
FT_READY = (FT_VENV / ".jaxsync-ft-setup").exists()
_MISSING_FT = f"needs the ULFM environment {FT_VENV} (build it: bash scripts/setup_ft.sh)"


def _ft_required_in_ci():
    pytest.fail(f"CI is set (scripts/test.sh builds it) but the test {_MISSING_FT}", pytrace=False)


# Skipped where the environment is missing, except in CI (CI=true), where
# scripts/test.sh builds it first: there a missing one fails.
requires_ft = (
    pytest.mark.usefixtures("_ft_present")
    if in_ci()
    else pytest.mark.skipif(not FT_READY, reason=_MISSING_FT)
)


@pytest.fixture
def _ft_present():
    if not FT_READY:
        _ft_required_in_ci()


def _env():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)  # this checkout; the .pth names the native library
    return env


def _launch(worker, tmp_path, timeout=60, args=(), n=3):
    cmd = [
        str(FT_VENV / "bin" / "mpirun"),
        "--with-ft",
        "ulfm",
        "--allow-run-as-root",
        "--oversubscribe",
        "-n",
        str(n),
        str(FT_VENV / "bin" / "python"),
        str(Path(__file__).parent / worker),
        str(tmp_path),
        *args,
    ]
    _, out, timed_out = run_command(cmd, timeout, env=_env())  # a hang: group killed
    if timed_out:
        out += f"\n(TIMED OUT after {timeout} s)"
    recs = {int(f.stem.split("-")[1]): json.loads(f.read_text()) for f in tmp_path.glob("rank-*")}
    assert "TIMED OUT" not in out, out
    return recs, out


@requires_ft
def test_survivors_of_a_killed_rank_revoke_shrink_sum_and_agree(tmp_path):
    recs, out = _launch("worker_elastic_ulfm.py", tmp_path)
    assert sorted(recs) == [0, 1], f"survivors' records: {sorted(recs)}\n{out}"
    for r, rec in recs.items():
        assert rec["library"].startswith("Open MPI v5"), rec
        assert rec["first_sum"] == 6, rec
        assert rec["error_class"] in ("MPI_ERR_PROC_FAILED", "MPI_ERR_REVOKED"), rec
        assert (rec["shrunk_size"], rec["shrunk_rank"]) == (2, r), rec
        assert rec["sum_on_survivors"] == 3 and rec["agreed"] == 1, rec


@requires_ft
def test_info_says_the_ft_environment_can_recover_in_process():
    def info(py):
        r = subprocess.run(
            [str(py), "-m", "jaxsync", "info", "--json"],
            capture_output=True,
            text=True,
            timeout=120,
            env=_env(),
            cwd=str(FT_VENV),
        )
        assert r.returncode == 0, r.stdout + r.stderr
        return json.loads(r.stdout.splitlines()[-1])

    ft = info(FT_VENV / "bin" / "python")
    assert ft["ulfm"].startswith("yes: Open MPI with ULFM"), ft
    assert "libmpi.so.40" in ft["native_mpi"]["links"], ft["native_mpi"]
    default = info(sys.executable)  # the default environment: the mpich wheel
    assert default["ulfm"].startswith("no: not Open MPI"), default


def _reference(ranks_after):
    """w and p after 6 steps: 0-2 on 3 ranks, 3-5 on ``ranks_after`` (float32, exact).

    Rank r's gradients are (r + 1) * c(t): their mean is 2 c(t) over 3 ranks, 1.5 c(t)
    over 2, c(t) over 1. w -= 0.5 * mean; p follows sgd(0.5, momentum=0.5): the
    momentum (one third on each rank before the loss) must come back whole; q (4
    leaves, overlap on) follows w, leaf j times j + 1; d (double buffering) applies
    step t - 1's gradients averaged over step t's ranks.
    """
    import numpy as np

    f = np.float32
    k = {1: f(1.0), 2: f(1.5), 3: f(2.0)}
    w, p, m = np.zeros((1, 4), f), np.zeros(6, f), np.zeros(6, f)
    q = [np.zeros((1, 64), f)] * 4
    d, pending = np.zeros((1, 4), f), np.zeros((1, 4), f)
    for t in range(6):
        mean = k[3 if t < 3 else ranks_after]
        ct = np.array([[t + 1, 0.5, -(t % 3), 0.25]], f)
        # double buffering: step t - 1's gradients (each rank's own, pending in its
        # state) averaged in step t over step t's world: the lost rank's is gone
        d = d - f(0.5) * (mean * pending)
        pending = ct
        cp = np.array([t + 1, 0.5, -(t % 3), 0.25, 2.0 - t, 0.75], f)
        w = w - f(0.5) * (mean * ct)
        q = [x - f(0.5) * (mean * (j + 1) * np.tile(ct, (1, 16))) for j, x in enumerate(q)]
        m = mean * cp + f(0.5) * m
        p = p - f(0.5) * m
    return w, p, q, d


def _check_bitwise(recs, ranks_after, out):
    import numpy as np

    # The stall watchdog stands aside (no thread dies on the revoked communicator).
    assert "Traceback" not in out, out
    w, p, q, d = _reference(ranks_after)
    for r, rec in recs.items():
        got_w, got_p = np.array(rec["w"], np.float32), np.array(rec["p"], np.float32)
        assert got_w.tobytes() == w.tobytes(), (r, got_w, w, out)
        assert got_p.tobytes() == p.tobytes(), (r, got_p, p, out)
        got_q = np.array(rec["q"], np.float32)
        assert got_q.tobytes() == np.stack(q).tobytes(), (r, got_q, q, out)
        got_d = np.array(rec["d"], np.float32)
        assert got_d.tobytes() == d.tobytes(), (r, got_d, d, out)
        # the exit drain went quiet (nothing of the revoked world left running)
        assert rec["quiet"] is True, rec


@requires_ft
def test_in_process_recovery_comm_auto_and_sharded_bitwise(tmp_path):
    """jaxsync.elastic.run: rank 2 killed at step 3; the survivors revoke jaxsync's
    communicators, shrink, agree on the commit of step 3, rebuild the sharded
    momentum (rank 2's third from rank 0's ring copy), make new transforms with
    comm="auto" (the current world) and finish: steps 0-2 averaged over 3 ranks, 3-5
    over 2, bitwise. topology() and broadcast_params (comm="auto") see the 2 survivors."""
    recs, out = _launch("worker_elastic_inprocess.py", tmp_path, timeout=120)
    assert sorted(recs) == [0, 1], f"survivors' records: {sorted(recs)}\n{out}"
    _check_bitwise(recs, 2, out)
    for r, rec in recs.items():
        assert (rec["rank"], rec["size"], rec["recoveries"], rec["commits"]) == (r, 2, 1, 7), rec
        assert rec["seen"] == {"topology": [r, 2], "broadcast": 0.0}, rec
        assert rec["recovery_s"]["restored_commit"] == 4, rec
        assert rec["times_s"]["held_at_failure"] == [3, 4], rec


@requires_ft
def test_a_process_lost_during_the_recovery_starts_a_second_one(tmp_path):
    """Rank 2 killed inside the commit after step 3 (rank 0's commit of step 3 fails:
    it is one behind, Agree picks the commit before, step 3 is redone), then rank 1
    inside its reset callback (during the recovery): rank 0 recovers again (Agree on
    the shrunk world, the sharded state from the ring copy made in the first recovery)
    and finishes alone, bitwise."""
    recs, out = _launch("worker_elastic_inprocess.py", tmp_path, timeout=120, args=["two"])
    assert sorted(recs) == [0], f"survivors' records: {sorted(recs)}\n{out}"
    _check_bitwise(recs, 1, out)
    rec = recs[0]
    assert (rec["rank"], rec["size"], rec["recoveries"], rec["commits"]) == (0, 1, 2, 7), rec
    assert rec["times_s"]["held_at_failure"] == [3, 4], rec  # not 5: its copy never came
    assert rec["recovery_s"]["restored_commit"] == 4, rec


@requires_ft
def test_two_ring_neighbours_lost_together_end_with_a_clear_error(tmp_path):
    """Ranks 1 and 2 killed at step 3: rank 1's sharded slices were held by rank 1 and
    its ring neighbour rank 2 only. Rank 0 ends run() with SlicesLost naming them (no
    hang, no silently re-initialised state)."""
    recs, out = _launch("worker_elastic_inprocess.py", tmp_path, timeout=120, args=["pair"])
    assert sorted(recs) == [0], f"survivors' records: {sorted(recs)}\n{out}"
    err = recs[0]["error"]
    assert "slices of rank(s) [1] (of the 3-rank world" in err and "[1, 2]" in err, err


def _local_reference(mode, steps=10, lost_from=7):
    """Three islands (rank r's gradient (r + 1) c(t), inner sgd(0.5)) up to step
    ``lost_from``, islands 0 and 1 from there; outer sgd(0.5, momentum=0.5) every 4
    steps on the mean of anchor - local (float32, exact); ``stream``: the mean sent
    at the outer step, applied one step later, params = 0.5 anchor + 0.5 local."""
    import numpy as np

    f = np.float32
    a, m = np.zeros(4, f), np.zeros(4, f)
    xs = [np.zeros(4, f) for _ in range(3)]
    sent = None
    for t in range(steps):
        alive = range(3 if t < lost_from else 2)
        ct = np.array([t + 1, 0.5, -(t % 3), 0.25], f)
        for r in alive:
            xs[r] = xs[r] - f(0.5) * (f(r + 1) * ct)
        n = t + 1
        if n % 4 == 0:
            pg = [a - xs[r] for r in alive]
            total = pg[0]
            for p in pg[1:]:
                total = total + p
            mean = total / f(len(pg)) if len(pg) == 3 else total * f(1.0 / len(pg))
            if mode == "diloco":
                m = mean + f(0.5) * m
                a = a - f(0.5) * m
                for r in alive:
                    xs[r] = a
            else:
                sent = mean
        if mode == "stream" and n % 4 == 1 and n > 1:
            m = sent + f(0.5) * m
            a = a - f(0.5) * m
            for r in alive:
                xs[r] = f(0.5) * a + f(0.5) * xs[r]
    return xs, a


@requires_ft
@pytest.mark.parametrize("mode", ["diloco", "stream", "sent"])
def test_local_updates_recover_on_the_survivors_bitwise(tmp_path, mode):
    """jaxsync.diloco with islands="process": rank 2 killed mid-interval (diloco) or
    with the outer mean in flight on streaming's lane (stream, overlap=True). The
    survivors make the transform on the shrunk world and finish: 3 islands in the
    outer step of step 3, 2 in that of step 7 (the lost island's local steps since
    the last outer step are gone with it; the anchor and outer state are kept),
    bitwise."""
    import numpy as np

    recs, out = _launch("worker_elastic_local.py", tmp_path, timeout=120, args=[mode])
    assert sorted(recs) == [0, 1], f"survivors' records: {sorted(recs)}\n{out}"
    assert "Traceback" not in out, out
    # sent: the commit after step 4 held the 3 islands' mean in flight; it lands at 5
    xs, a = _local_reference(
        "stream" if mode == "sent" else mode, lost_from=4 if mode == "sent" else 7
    )
    for r, rec in recs.items():
        got = np.array(rec["x"], np.float32)
        assert got.tobytes() == xs[r].tobytes(), (r, got, xs[r], out)
        assert np.array(rec["anchor"], np.float32).tobytes() == a.tobytes(), (rec, a)
        assert (rec["size"], rec["islands"], rec["recoveries"]) == (2, 2, 1), rec
        # diloco: the commit after step 4, 5 or 6, by where the survivors raised (the
        # local steps are the same on 3 islands or 2); stream: after step 6 (no
        # commit right after a send step, 3; the mean sent at 7 fails at 7 or 8)
        ok = {"diloco": (6, 7, 8), "stream": (7,), "sent": (5,)}[mode]
        assert rec["recovery_s"]["restored_commit"] in ok, rec
        assert rec["quiet"] is True, rec


@requires_ft
def test_host_tier_pipelined_requests_fail_and_survivors_finish_bitwise(tmp_path):
    """Two (test) hosts of two processes, hierarchical_mean(host_tier=True) on 4 chunks
    (pipelined in one native call); rank 3 killed at step 3: the survivors' tier
    requests fail (no hang), they recover onto hosts {0, 1} and {2} (a tier still)
    and finish: steps 0-2 summed over 4 ranks, 3-5 over 3, bitwise."""
    import numpy as np

    recs, out = _launch("worker_elastic_tier.py", tmp_path, timeout=120, n=4)
    assert sorted(recs) == [0, 1, 2], f"survivors' records: {sorted(recs)}\n{out}"
    assert "Traceback" not in out, out
    f, w = np.float32, np.zeros(4, np.float32)
    for t in range(6):
        w = w - f(0.5) * (f(10 if t < 3 else 6) * np.array([t + 1, 0.5, -(t % 3), 0.25], f))
    for rec in recs.values():
        assert np.array(rec["head"], f).tobytes() == w.tobytes() and rec["same"], (rec, w)
        assert (rec["size"], rec["recoveries"], rec["quiet"]) == (3, 1, True), rec
        assert rec["tiers"][0] == 2 and rec["tiers"][-1] == 2, rec  # the tier, both worlds

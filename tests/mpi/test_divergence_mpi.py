"""Ranks that decide differently get an error on every rank, never a hang (issue 46).

``worker_divergence.py`` runs every case in one job: a tree with nothing to
reduce or an int32 leaf on one rank (every strategy, ``sharded``), a
``broadcast_params`` root that differs, strategies that differ, a compiled step
run again on one rank while the other runs another, ``optax.apply_if_finite``
skipping the sync on one rank only (the header's step count), a sync inside a
``lax.cond`` taken alike (no false alarm); ``accumulate`` and
``sharded(accumulate=k)`` with another ``k`` or a NaN micro-step on one rank,
``weights=True`` on one rank, ``Quantized`` against float32 or another block,
``diloco`` with another outer optimizer, outer learning rate or ``fragments`` (a rank done early is
``test_join_mpi.py``'s, a NaN island ``test_local_mpi.py``'s). ``worker_abort.py``: an uncaught
trace-time error on one rank ends the job while the other waits in a sync with
no stall timeout.
"""

from __future__ import annotations

import sys

from mpi_harness import requires_mpi, run_mpi

STRATEGIES = ("naive", "flat", "hierarchical", "two_dimensional")


def _same_error(run, key, *needles):
    """Both ranks failed ``key`` with the same message, which holds ``needles``."""
    got = [run.results[r][key] for r in range(2)]
    for r, (kind, msg) in enumerate(got):
        assert kind != "OK", f"rank {r} {key}: no error\n{run.describe()}"
        for needle in needles:
            assert needle in msg, f"rank {r} {key}: {needle!r} not in {msg}"
    strip = lambda m: m[m.index("jaxsync:") :]  # noqa: E731 - JAX's prefix may differ
    assert strip(got[0][1]) == strip(got[1][1]), got


@requires_mpi
def test_divergent_paths_fail_on_every_rank():
    run = run_mpi("worker_divergence.py", n=2, devices=2, args=("--watchdog", 150), timeout=200)
    assert run.returncode == 0 and all(run.results), run.describe()
    # (3) nothing to reduce, or int32 against float32: the tree differs, on both ranks.
    for strategy in STRATEGIES:
        _same_error(run, f"empty-{strategy}", "gradient tree differs", "rank 1: leaf ['w']")
        _same_error(run, f"ints-{strategy}", "rank 0: leaf ['w'] (3,) int32")
    _same_error(run, "empty-sharded", "gradient tree differs")
    _same_error(run, "empty-host", "gradient tree differs")
    # (4) the root is compared: named, every rank raises.
    _same_error(run, "root", "broadcast root differs", "rank 0: root 0", "rank 1: root 1")
    # (11) the option that differs is named, not a plan line it implies.
    _same_error(run, "strategy", "options differ", "strategy hierarchical", "strategy flat")
    assert "bucket_bytes" not in run.results[0]["strategy"][1]
    # The header is checked on every run, not only an executable's first.
    assert run.results[0]["rerun-first"][0] == run.results[1]["rerun-first"][0] == "OK"
    _same_error(run, "rerun", "gradient tree differs", "(3,)", "(5,)")
    # A sync in a lax.cond taken alike: no false alarm, exact (the P() input
    # counts on device 0 only: (1 + 3) / 4 = 1; untaken, each rank's own value).
    for i in range(4):
        for r in range(2):
            kind, out = run.results[r][f"cond-alike-{i}"]
            assert kind == "OK", (r, i, out)
            want = 1.0 if i % 2 == 0 else 2.0 * r + 1
            assert out["w"].tolist() == [want] * 4, (r, i, out)
    # apply_if_finite skips rank 0's sync at step 1: rank 1's check of step 1
    # and rank 0's of step 2 pair, and fail on both with the same message.
    r0, r1 = run.results
    assert r0["skip-0"][0] == r1["skip-0"][0] == "OK"
    assert r0["skip-1"][0] == "OK" and "skip-2" not in r1
    msg = "rank 0 reached it 2 times and rank 1 once: a rank skipped it"
    assert msg in r0["skip-2"][1] and msg in r1["skip-1"][1], (r0["skip-2"], r1["skip-1"])
    # The entry points added since (each case stops at its first error).
    # accumulate with k = 2 on rank 0, 3 on rank 1: rank 0 runs the sync at its
    # 2nd call, rank 1 at its 3rd; both fail there alike, k named (it was only
    # counted: "rank 0 reached it 2 times and rank 1 3 times").
    r0, r1 = run.results
    assert r0["acc-k-0"][0] == r1["acc-k-1"][0] == "OK" and "acc-k-2" not in r0
    for r, key in ((0, "acc-k-1"), (1, "acc-k-2")):
        msg = run.results[r][key][1]
        assert "options differ" in msg and "accumulate 2" in msg and "accumulate 3" in msg
    strip = lambda m: m[m.index("jaxsync:") :]  # noqa: E731
    assert strip(r0["acc-k-1"][1]) == strip(r1["acc-k-2"][1])
    # A NaN micro-step on rank 0 only: the accumulated step (micro-steps 0, 1) is
    # skipped on both, the next one is the mean of micro-steps 2, 3 (3 and 4).
    # sharded(accumulate=2) under jaxsync.apply_if_finite: the NaN micro-step is
    # dropped on both, the next two (2 and 3) are applied.
    for key, want in (("acc-nan", [0, 0, 0, -3.5]), ("zero2-nan", [0, 0, -2.5])):
        for r in range(2):
            got = [run.results[r][f"{key}-{i}"] for i in range(len(want))]
            assert [k for k, _ in got] == ["OK"] * len(want), (r, key, got)
            assert [u["w"].tolist() for _, u in got] == [[w] * 3 for w in want], (r, key, got)
    # sharded(accumulate=k) with another k: it hung (rank 0 all-gathering while
    # rank 1 reduce-scatters its next micro-step); now the first step names it.
    _same_error(run, "zero2-k-0", "options differ", "accumulate 2", "accumulate 3")
    # weights=True on rank 0 only: named as weights (not the sum it implies).
    _same_error(run, "weights-0", "options differ", "(weights)", "weights True", "weights <unset>")
    # the same on sign_mean: it was named as reduce (its weights' sum), not weights.
    _same_error(run, "weights-sign-0", "options differ", "(weights)", "weights True")
    # Quantized on one rank, float32 or another block on the other: comm_dtype.
    _same_error(run, "quant-f32-0", "(comm_dtype)", "block=2", "comm_dtype None")
    _same_error(run, "quant-block-0", "(comm_dtype)", "block=2", "block=4")
    # diloco: another outer optimizer (its state), another fragments: both ranks.
    _same_error(run, "local-outer-0", "diloco configuration differs", "outer state")
    # the same outer optimizer with another learning rate: the outer probe's numbers
    # (the anchors drifted apart silently: 0.25 against 0.625 after 2 steps)
    _same_error(run, "local-outer-lr-0", "diloco configuration differs", "outer probe -0.5")
    _same_error(run, "local-fragments-0", "diloco configuration differs", "fragments 2")
    # Still in step after every error.
    for r in range(2):
        assert run.results[r]["after"][0] == "OK", run.results[r]["after"]
        assert run.results[r]["after"][1]["w"].tolist() == [1.0] * 4


@requires_mpi
def test_one_error_raised_by_all_ranks_reaches_the_output():
    """Both ranks raise the same error uncaught (their trees differ): whichever
    aborts first, the full explanation is in the job's output, every time (the
    old hook lost it in 3 of 10 runs on the 2-core machine under load: the first
    MPI_Abort killed the launcher's forwarding while the ranks printed)."""
    for i in range(5):  # about 3.5 s each
        run = run_mpi("worker_abort_all.py", n=2, devices=1, timeout=60)
        assert not run.timed_out and run.returncode != 0, run.describe()
        for needle in (
            "jaxsync: the gradient tree differs between rank 0 and rank 1",
            "Fix: make every process build the same gradient tree",
            "raised JaxRuntimeError uncaught; ending the MPI job",
        ):
            assert needle in run.output, f"run {i}: {needle!r} missing\n{run.describe()}"


@requires_mpi
def test_an_uncaught_error_on_one_rank_ends_the_job():
    """Rank 0 raises while tracing; rank 1 waits in a sync with no timeout:
    the job ends non-zero, rank 0's error in its output."""
    run = run_mpi("worker_abort.py", n=2, devices=1, timeout=120)
    assert not run.timed_out, run.describe()
    assert run.returncode != 0, run.describe()
    assert "sharded: the gradient leaf ['w'] is of dtype int32" in run.output, run.describe()
    assert "rank 0 raised TypeError uncaught; ending the MPI job" in run.output
    assert "finished the step" not in run.output


class _Comm:
    def __init__(self, size):
        self.size, self.aborted = size, []

    def Get_size(self):
        return self.size

    def Get_rank(self):
        return 0

    def Abort(self, code):
        self.aborted.append(code)


def test_the_abort_hook_chains_and_can_be_turned_off(monkeypatch, capfd):
    from jaxsync._comm import _abort

    seen = []
    monkeypatch.setattr(_abort, "GRACE_S", 0.0)
    monkeypatch.setattr(_abort, "_state", {})
    _abort.install(_Comm(2))  # not an mpi4py communicator: left alone
    assert not _abort.installed()
    monkeypatch.setattr(_abort, "_is_mpi", lambda comm: True)
    monkeypatch.setattr(sys, "excepthook", lambda *a: seen.append(a[0]))
    _abort.install(_Comm(1))  # one process: nothing to end
    monkeypatch.setenv(_abort.ENV, "0")
    _abort.install(_Comm(2))  # turned off
    assert not _abort.installed()
    monkeypatch.delenv(_abort.ENV)
    comm = _Comm(2)
    _abort.install(comm)
    assert _abort.installed()
    sys.excepthook(ValueError, ValueError("x"), None)
    assert seen == [ValueError] and comm.aborted == [1]  # the user's hook ran first
    err = capfd.readouterr().err  # written to fd 2 in one write, past sys.stderr
    assert "JAXSYNC_ABORT_ON_ERROR=0" in err and "It was:\nValueError: x" in err
    sys.excepthook(KeyboardInterrupt, KeyboardInterrupt(), None)
    assert comm.aborted == [1]  # ^C: the launcher ends every process itself

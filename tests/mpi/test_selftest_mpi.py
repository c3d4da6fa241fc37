"""``python -m jaxsync selftest`` under mpirun: passes on a sound launch (every
case, the compressed and asynchronous ones included), fails on every rank
(non-zero exit) when the ranks disagree (here: their device counts) or when one
case is wrong on one rank."""

import os
import sys

from _common import SELFTEST_EXTRA_CASES
from mpi_harness import MPIRUN, ROOT, requires_mpi, run_command, run_mpi

from jaxsync._cli._selftest import table_rows as _rows

pytestmark = requires_mpi


def _env():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _selftest(devices):
    """``mpirun`` with one ``-n 1 ... --devices D`` block per rank (MPMD)."""
    cmd = [str(MPIRUN)]
    for i, d in enumerate(devices):
        cmd += [":"] if i else []
        cmd += ["-n", "1", sys.executable, "-m", "jaxsync", "selftest", "--mbytes", "1"]
        cmd += ["--iters", "2", "--devices", str(d)]
    return run_command(cmd, timeout=240, env=_env())


CASES = [
    f"{name}{option}"
    for name in ("naive", "flat", "hierarchical", "two_dimensional")
    for option in ("", " bf16", " host")
] + list(SELFTEST_EXTRA_CASES)


def test_selftest_passes_on_two_processes():
    rc, out, timed_out = _selftest([2, 2])
    assert not timed_out and rc == 0, out[-3000:]
    assert "selftest passed" in out
    rows = _rows(out)
    assert sorted(rows) == sorted(CASES), rows
    for case in CASES:
        assert rows[case][0] == "PASS", (case, rows[case])
    assert rows["powersgd rank 2"][1].startswith("w within "), rows
    assert rows["hierarchical double_buffering"][1].startswith("exact: step 1 zeros"), rows
    assert "processes of a host (MPI, shared memory)" in out
    assert "devices of a process (psum)" in out


def test_selftest_fails_when_the_ranks_disagree():
    rc, out, timed_out = _selftest([1, 2])
    assert not timed_out, out[-3000:]
    assert rc != 0, out[-3000:]
    assert "processes drive different numbers of devices: [1, 2]" in out
    assert "selftest FAILED" in out


def test_selftest_fails_on_every_rank_when_one_rank_is_wrong():
    r = run_mpi("worker_selftest.py", n=2, devices=2, timeout=240)
    assert not r.timed_out, r.describe()
    assert [res and res["rc"] for res in r.results] == [1, 1], r.describe()
    rows = _rows(r.output)
    assert rows["sign"][0] == "FAIL", r.describe()
    assert rows["sign"][1].startswith("rank 1: step 1 c: device 0 value 0 is"), rows["sign"]
    assert all(ok == "PASS" for case, (ok, _) in rows.items() if case != "sign"), rows
    assert "selftest FAILED" in r.output

"""python -m jaxsync elastic under the real mpirun: a rank is lost, the job goes on.

One supervised job of a few seconds (numpy and mpi4py, tests/mpi/worker_elastic_train.py):
two processes train, rank 1 is killed (SIGKILL) when it reaches step 5, the
supervisor restarts on the one slot left, the script resumes from its checkpoint,
and the final parameters equal bitwise the closed form: steps 0-4 averaged over two
ranks, steps 5-7 over one.
"""

import json
import os
import sys

import numpy as np
from mpi_harness import MPIRUN, ROOT, requires_mpi, run_command

STEPS, KILL_AT, LR = 8, 5, 0.5


def _reference():
    w = np.zeros(4)
    for t in range(STEPS):
        c = np.array([t + 1, 0.5, -(t % 3), 0.25], dtype=np.float64)
        mean = (1 + 2) / 2 * c if t < KILL_AT else c  # (rank 0 + rank 1) / 2, then rank 0
        w = w - LR * mean
    return w


@requires_mpi
def test_a_killed_rank_restarts_on_the_slot_left_from_the_checkpoint(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "jaxsync",
        "elastic",
        "--min-np",
        "1",
        "--max-np",
        "2",
        "--max-restarts",
        "2",
        "--mpirun",
        str(MPIRUN),
        "--",
        sys.executable,
        str(ROOT / "tests" / "mpi" / "worker_elastic_train.py"),
        str(tmp_path),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    rc, out, timed_out = run_command(cmd, 120, env=env)
    assert not timed_out, f"the supervised job hung:\n{out}"
    assert rc == 0, out
    runs = [json.loads(x) for x in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert runs == [
        {"restart": 0, "np": 2, "start": 0},
        {"restart": 1, "np": 1, "start": KILL_AT},
    ], out
    assert "run 0 failed" in out and "rank 1 (pid" in out and "run 1 finished" in out, out
    final = np.load(tmp_path / "final.npy")
    ref = _reference()
    assert final.dtype == ref.dtype and final.tobytes() == ref.tobytes(), (final, ref)
    # the wrong anchors give other values: all steps on 2 ranks, or all on 1
    assert not np.array_equal(ref, -LR * 1.5 * sum(_c(t) for t in range(STEPS)))
    assert not np.array_equal(ref, -LR * sum(_c(t) for t in range(STEPS)))


def _c(t):
    return np.array([t + 1, 0.5, -(t % 3), 0.25], dtype=np.float64)

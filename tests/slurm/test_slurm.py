"""jaxsync under a real Slurm: ``srun --mpi=pmi2`` with the mpich wheel's processes.

One private Slurm for the module (conftest.py's ``slurm`` fixture: munged, slurmctld and
one slurmd, node ``jaxsync0``, under a temporary folder; see slurm_harness.py), then:
``python -m jaxsync info`` on 2 tasks, ``jaxsync.topology()`` against Slurm's own
variables on every rank, a short exact training run, and the restarting supervisor
(``python -m jaxsync elastic --mpirun srun`` inside ``salloc`` and in an ``sbatch``
script) through a rank lost at a step, and ``srun --mpi=none`` refused by
``comm="auto"`` (it would train every task alone). Every command runs with a timeout: a hang fails,
it does not block.
"""

import json
import os
import shlex

import numpy as np
import pytest
from slurm_harness import HERE, NODE, PYTHON, requires_slurm

pytestmark = requires_slurm

# One fake CPU device per process, and srun's tasks find the venv's programs.
ENV = {
    "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
    "PATH": os.pathsep.join([os.path.dirname(PYTHON), os.environ.get("PATH", "")]),
}
STEPS, LR = 8, 0.5
# --kill-on-bad-exit: a rank that fails ends the step, the other does not wait on it
SRUN = ["srun", "-n", "2", "--kill-on-bad-exit=1", "--mpi=pmi2"]


def _c(t):
    return np.array([t + 1, 0.5, -(t % 3), 0.25], dtype=np.float32)


def _reference(sizes):
    """The closed form of worker_train.py: step t averaged over ``sizes[t]`` ranks."""
    w = np.zeros(4, np.float32)
    for t in range(STEPS):
        n = sizes[t]
        mean = np.float32(sum(range(1, n + 1)) / n) * _c(t)  # ranks' (r + 1) * c(t)
        w = (w - np.float32(LR) * mean).astype(np.float32)
    return w


def test_jaxsync_info_sees_two_processes_from_srun(slurm):
    r = slurm.run([*SRUN, PYTHON, "-m", "jaxsync", "info"], 120, ENV)
    assert not r.timed_out and r.returncode == 0, r.describe()
    # one topology row per rank: "│ rank │ size │ host │ hosts │ local_rank │ local_size │"
    rows = [
        [c.strip() for c in line.split("│")[1:-1]]
        for line in r.output.splitlines()
        if line.startswith("│")
    ]
    assert sorted(row[:6] for row in rows) == [
        ["0", "2", "0", "1", "0", "2"],
        ["1", "2", "0", "1", "1", "2"],
    ], r.describe()
    assert "mpi_library: MPICH" in r.output, r.describe()


def test_topology_matches_slurms_view_on_every_rank(slurm, tmp_path):
    cmd = [*SRUN, PYTHON, HERE / "worker_topology.py", tmp_path]
    r = slurm.run(cmd, 120, ENV)
    assert not r.timed_out and r.returncode == 0, r.describe()
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        t, env = got["topology"], got["env"]
        assert env["SLURM_PROCID"] == str(rank) and env["SLURM_NTASKS"] == "2", env
        assert env["SLURM_JOB_NODELIST"] == NODE and env["SLURM_NNODES"] == "1", env
        assert env["PMI_RANK"] == str(rank) and env["PMI_SIZE"] == "2", env  # pmi2's
        assert (t["rank"], t["size"]) == (int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]))
        assert (t["host"], t["hosts"]) == (int(env["SLURM_NODEID"]), int(env["SLURM_NNODES"]))
        assert t["local_rank"] == int(env["SLURM_LOCALID"]), (t, env)
        assert t["local_size"] == int(env["SLURM_TASKS_PER_NODE"]), (t, env)
        assert (t["local_devices"], t["platform"]) == (1, "cpu"), t


def test_training_under_srun_is_exact_and_identical_on_both_ranks(slurm, tmp_path):
    cmd = [*SRUN, PYTHON, HERE / "worker_train.py", tmp_path]
    r = slurm.run(cmd, 180, ENV)
    assert not r.timed_out and r.returncode == 0, r.describe()
    ref = _reference([2] * STEPS)
    finals = [np.load(tmp_path / f"final-rank{rank}.npy") for rank in range(2)]
    for final in finals:
        assert final.dtype == ref.dtype and final.tobytes() == ref.tobytes(), (finals, ref)
    # the ranks really averaged: one rank alone (or a sum) ends elsewhere
    assert not np.array_equal(ref, _reference([1] * STEPS))
    runs = [json.loads(x) for x in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert runs == [{"restart": 0, "np": 2, "start": 0}], runs


@pytest.mark.parametrize("how", ["salloc", "sbatch"])
def test_supervisor_in_an_allocation_restarts_a_lost_rank_from_the_checkpoint(slurm, tmp_path, how):
    kill_at = 3
    supervise = [
        PYTHON, "-m", "jaxsync", "elastic", "--min-np", "1", "--max-np", "2",
        "--max-restarts", "2", "--mpirun", "srun", "--",
        PYTHON, HERE / "worker_train.py", tmp_path, "--kill-at", str(kill_at),
    ]  # fmt: skip
    if how == "salloc":
        r = slurm.run(["salloc", "-n", "2", "--time=5", "--quiet", *supervise], 300, ENV)
        out = r.output
    else:  # a batch script: the supervisor is its one command, srun makes the steps
        job = tmp_path / "job.sh"
        job.write_text("#!/bin/sh\n#SBATCH -n 2\nexec " + shlex.join(map(str, supervise)) + "\n")
        log = tmp_path / "job.out"
        r = slurm.run(["sbatch", "--wait", "--time=5", f"--output={log}", job], 300, ENV)
        out = r.output + (log.read_text() if log.exists() else "(no job output)")
    assert not r.timed_out and r.returncode == 0, r.describe() + out
    assert f"capacity from the Slurm allocation: {NODE}:2" in out, out
    assert "srun -n 2 --kill-on-bad-exit=1 --mpi=pmi2" in out, out
    assert f"srun: error: {NODE}: task 1: Killed" in out, out
    assert "run 0 failed" in out and f"rank 1 on {NODE}" in out, out
    assert "run 1 on 1 process(es)" in out and "run 1 finished" in out, out
    runs = [json.loads(x) for x in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert runs == [
        {"restart": 0, "np": 2, "start": 0},
        {"restart": 1, "np": 1, "start": kill_at},
    ], out
    final = np.load(tmp_path / "final-rank0.npy")
    ref = _reference([2] * kill_at + [1] * (STEPS - kill_at))
    assert final.dtype == ref.dtype and final.tobytes() == ref.tobytes(), (final, ref)
    # the wrong anchors end elsewhere: every step on 2 ranks, or every step on 1
    assert not np.array_equal(ref, _reference([2] * STEPS))
    assert not np.array_equal(ref, _reference([1] * STEPS))
    assert not (tmp_path / "final-rank1.npy").exists()


def test_srun_without_mpi_wiring_is_refused_not_trained_alone(slurm):
    """``srun --mpi=none``: no PMI variables, so each task's MPI would be a world of
    one and ``comm="auto"`` would leave every task training alone; it raises on
    every task, naming ``--mpi=pmi2``."""
    code = "import jaxsync; jaxsync.hierarchical_mean(axis_name=None)"
    line = ["srun", "-n", "2", "--mpi=none", PYTHON, "-c", code]
    r = slurm.run(line, 120, ENV)
    assert not r.timed_out and r.returncode != 0, r.describe()
    assert r.output.count("LaunchError") >= 2, r.describe()
    assert "SLURM_STEP_NUM_TASKS=2" in r.output and "srun --mpi=pmi2" in r.output, r.describe()

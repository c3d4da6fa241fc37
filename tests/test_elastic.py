"""The elastic supervisor's loop against a fake launcher (no MPI, each run ~0.1 s).

The fake ``mpirun`` records each launch (``-n``, hosts, the supervisor's environment)
and, while a counter file says so, fails as MPICH's hydra does (a BAD TERMINATION box
naming a PID and a host), with the pid -> rank record that ``world()`` leaves.
"""

import json
import sys

import pytest

from jaxsync.elastic import _cli, _supervise

FAKE = r"""
import json, os, sys
args = sys.argv[1:]
if args == ["--version"]:
    print("HYDRA build details: fake"); sys.exit(0)
here = os.path.dirname(os.path.abspath(__file__))
n = int(args[args.index("-n") + 1])
hosts = args[args.index("-hosts") + 1] if "-hosts" in args else None
with open(os.path.join(here, "launches.jsonl"), "a") as f:
    f.write(json.dumps({"n": n, "hosts": hosts,
                        "restart": os.environ["JAXSYNC_ELASTIC_RESTART"],
                        "np": os.environ["JAXSYNC_ELASTIC_NP"]}) + "\n")
fails = int(open(os.path.join(here, "fails")).read())
if fails > 0:
    open(os.path.join(here, "fails"), "w").write(str(fails - 1))
    lost = n - 1  # the last rank is lost; it had recorded its pid, as world() does
    with open(os.path.join(os.environ["JAXSYNC_ELASTIC_DIR"], "pid-4242"), "w") as f:
        f.write(str(lost))
    cap = os.path.join(here, "capacity")
    if os.path.exists(cap):  # discovery: the lost host is gone from the answer
        os.replace(os.path.join(here, "capacity.after"), cap)
    print("=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES")
    print("=   PID 4242 RUNNING AT somewhere")
    print("=   EXIT CODE: 9")
    sys.exit(9)
print("fake job done")
"""


def _setup(tmp_path, fails):
    (tmp_path / "mpirun.py").write_text(FAKE)
    (tmp_path / "fails").write_text(str(fails))
    return f"{sys.executable} {tmp_path / 'mpirun.py'}"


def _launches(tmp_path):
    f = tmp_path / "launches.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []


def _main(argv, mpirun):
    return _cli.main(["--mpirun", mpirun, *argv, "--", "python", "train.py"])


def test_each_lost_process_costs_its_slot_until_the_job_finishes(tmp_path, capsys):
    mpirun = _setup(tmp_path, fails=2)
    rc = _main(["--min-np", "1", "--max-np", "4", "--hosts", "a:2,b:2"], mpirun)
    assert rc == 0, capsys.readouterr().err
    got = [(x["n"], x["hosts"], x["restart"], x["np"]) for x in _launches(tmp_path)]
    # rank 3 (on b) lost, then rank 2 (on b): b has no slot left
    assert got == [(4, "a:2,b:2", "0", "4"), (3, "a:2,b:1", "1", "3"), (2, None, "2", "2")]
    err = capsys.readouterr().err
    assert "rank 3 (pid 4242) on b" in err and "rank 2 (pid 4242) on b" in err, err


def test_gives_up_after_max_restarts_with_the_jobs_exit_status(tmp_path, capsys):
    mpirun = _setup(tmp_path, fails=5)
    rc = _main(["--min-np", "1", "--max-np", "3", "--max-restarts", "1"], mpirun)
    assert rc == 9
    assert [x["n"] for x in _launches(tmp_path)] == [3, 2]
    assert "giving up: --max-restarts 1 reached; exit status 9" in capsys.readouterr().err


def test_never_goes_below_min_np(tmp_path, capsys):
    mpirun = _setup(tmp_path, fails=1)
    rc = _main(["--min-np", "2", "--max-np", "2", "--max-restarts", "5"], mpirun)
    assert rc == 9
    assert [x["n"] for x in _launches(tmp_path)] == [2]
    err = capsys.readouterr().err
    assert "giving up: 1 slot(s) left (localhost:1), fewer than --min-np 2" in err, err


def test_discovery_script_decides_the_capacity_and_grows_back_to_max_np(tmp_path, capsys):
    mpirun = _setup(tmp_path, fails=1)
    (tmp_path / "capacity").write_text("h1:2\nh2:2\n")
    (tmp_path / "capacity.after").write_text("h1:2\nh3:1\n")  # h2 lost, h3 came
    script = f"cat {tmp_path / 'capacity'}"
    rc = _main(["--min-np", "1", "--max-np", "3", "--host-discovery-script", script], mpirun)
    assert rc == 0, capsys.readouterr().err
    got = [(x["n"], x["hosts"]) for x in _launches(tmp_path)]
    assert got == [(3, "h1:2,h2:1"), (3, "h1:2,h3:1")]


def test_bad_arguments_name_the_option():
    with pytest.raises(SystemExit):
        _cli.main(["--min-np", "3", "--max-np", "2", "--", "python", "x.py"])
    with pytest.raises(ValueError, match="--hosts: expected host:slots"):
        _supervise.parse_hosts("a:x")


def test_world_outside_and_inside_the_supervisor(tmp_path, monkeypatch):
    import jaxsync.elastic as el

    assert el.world() == el.ElasticWorld()
    for k, v in {
        "JAXSYNC_ELASTIC_RESTART": "2",
        "JAXSYNC_ELASTIC_NP": "3",
        "JAXSYNC_ELASTIC_MIN_NP": "1",
        "JAXSYNC_ELASTIC_MAX_NP": "4",
        "JAXSYNC_ELASTIC_HOSTS": "a:3",
        "JAXSYNC_ELASTIC_DIR": str(tmp_path),
        "PMI_RANK": "2",
    }.items():
        monkeypatch.setenv(k, v)
    w = el.world()
    assert (w.restart, w.np, w.min_np, w.max_np, w.hosts, w.supervised) == (2, 3, 1, 4, "a:3", True)
    [rec] = list(tmp_path.glob("pid-*"))
    assert rec.read_text() == "2"


def test_state_commits_copies_keeps_two_and_restores_the_agreed_one():
    import numpy as np

    from jaxsync.elastic import State
    from jaxsync.elastic._run import is_process_failure

    s = State(comm=object(), w=np.zeros(2), step=0)
    for k in range(3):
        s.w = s.w + 1.0
        s.step = k + 1
        s.commit()
        s.w[0] = 99.0  # a later in-place change: the commit holds a copy
    assert s.commits == 3 and [n for n, _, _ in s._commits] == [2, 3]
    s._restore(2)  # a survivor one commit ahead goes back to the agreed one
    assert s.step == 2 and s.w.tolist() == [100.0, 2.0] and s.commits == 2  # not 99
    with pytest.raises(KeyError):
        s._restore(1)  # only the last two are kept
    assert is_process_failure(ValueError("MPI_Allgather failed: MPI_ERR_REVOKED: ..."))
    assert not is_process_failure(ValueError("MPI_ERR_TRUNCATE"))


def test_commit_agreement_flags_and_ring_holders():
    from jaxsync.elastic import SlicesLost
    from jaxsync.elastic._run import flag, newest_common
    from jaxsync.elastic._shards import holders

    # Agree ANDs the flags: the newest commit that every survivor holds.
    assert newest_common([30, 31], flag([30, 31]) & flag([30, 31])) == 31  # 31 % 31 == 0
    assert newest_common([30, 31], flag([30, 31]) & flag([29, 30])) == 30
    assert newest_common([29, 30], flag([30, 31]) & flag([29, 30])) == 30
    assert newest_common([1], flag([1]) & flag([])) is None
    # 4 ranks, rank r's slices kept by r and r + 1: survivors 0 and 2 hold them all.
    assert holders(4, {0: (0, 3), 2: (2, 1)}) == {0: 0, 1: 2, 2: 2, 3: 0}
    with pytest.raises(SlicesLost, match=r"slices of rank\(s\) \[1\] .* ranks \[1, 2\]"):
        holders(4, {0: (0, 3), 3: (3, 2)})  # 1 and 2 (neighbours) lost together


def test_run_reraises_what_is_not_a_process_failure():
    from jaxsync.elastic import State, run

    def train(state):
        raise ValueError("a bug in the training step")

    with pytest.raises(ValueError, match="a bug"):
        run(train, State(comm=object()))
    assert run(lambda st: st.x * 2, State(comm=object(), x=21)) == 42


class _FakeComm:
    """A communicator that records its revoke (the lane only duplicates it here)."""

    def __init__(self, size=3):
        self.size, self.revoked = size, False

    def Dup(self):
        return _FakeComm(self.size)

    def Get_size(self):
        return self.size

    def py2f(self):
        return -7  # never passed to MPI here: no sum is started

    def allgather(self, x):
        return [x] * self.size

    def Revoke(self):
        self.revoked = True


def test_recovery_revokes_the_islands_and_fails_their_lanes(monkeypatch):
    """The old world's islands (split communicators) and streaming's in-flight lane
    are jaxsync's to revoke: recovery revokes the island's and the lane's own
    communicators, fails every sum in flight (the native ``fail_all``, with
    MPI_ERR_REVOKED in its text, which run() reads as a process failure) and
    forgets both, so a transform made afterwards gets new islands and a new lane."""
    from jaxsync.elastic import _run
    from jaxsync.local import _inflight, _islands

    world, outer = _FakeComm(), _FakeComm()
    isl = _islands.Islands("process", None, None, outer, 3, 0)
    monkeypatch.setitem(_islands._MADE, (id(world), "process"), (world, isl))
    ln = _inflight.lane(outer)
    monkeypatch.setitem(_inflight._LANES, id(outer), (outer, ln))
    failed: list = []
    monkeypatch.setattr(_inflight, "fail_all", lambda text: failed.append(text) or 0)
    got = _run._derived(world)
    assert any(c is outer for c in got) and any(c is ln.comm for c in got), got
    _run._fail_lanes(world, RuntimeError(_run._LOST.format(3)))
    assert len(failed) == 1 and "MPI_ERR_REVOKED" in failed[0], failed
    assert _run.is_process_failure(RuntimeError(failed[0]))
    assert (id(world), "process") not in _islands._MADE and id(outer) not in _inflight._LANES


def test_islands_given_as_a_communicator_are_revoked_by_a_recovery_too():
    """islands=<an mpi4py communicator>: its communicators are kept with the split
    ones, so jaxsync.elastic's recovery finds (revokes, forgets) them; they were
    missed (only islands="process" / "host" were found)."""
    from mpi4py import MPI

    import jaxsync
    from jaxsync.elastic import _run
    from jaxsync.local import _islands

    world = MPI.COMM_SELF.Dup()
    try:
        mine = world.Dup()
        jaxsync.islands(mine, comm=world)
        found = [isl for (k, _), (w, isl) in _islands._MADE.items() if w is world]
        assert len(found) == 1 and found[0].kind == "comm", found
        _run._fail_lanes(world, RuntimeError("lost: MPI_ERR_REVOKED"))
        assert not [w for w, _ in _islands._MADE.values() if w is world]
    finally:
        world.Free()


FAKE_SRUN = r"""
import json, os, sys
args = sys.argv[1:]
if args == ["--version"]:
    print("slurm 23.11.4"); sys.exit(0)
here = os.path.dirname(os.path.abspath(__file__))
n = int(args[args.index("-n") + 1])
with open(os.path.join(here, "launches.jsonl"), "a") as f:
    f.write(json.dumps({"args": args[: args.index("python")],
                        "np": os.environ["JAXSYNC_ELASTIC_NP"]}) + "\n")
fails = int(open(os.path.join(here, "fails")).read())
how = open(os.path.join(here, "how")).read()
if fails > 0 and how == "pmi2":  # MPI failed to start: Slurm 22.05's pmi2, MPICH's UCX
    open(os.path.join(here, "fails"), "w").write(str(fails - 1))
    print("slurmstepd-n1: error: mpi/pmi2: value not properly terminated in client request")
    print("srun: error: n1: task 0: Exited with exit code 15")
    print("srun: error: n2: task 2: Terminated")
    sys.exit(143)
if fails > 0 and how == "node":  # node n2 lost, as Slurm 22.05 reports it (salloc --no-kill)
    open(os.path.join(here, "fails"), "w").write(str(fails - 1))
    print("srun: error: Node failure on n2")
    print("srun: error: n1: tasks 0-1: Killed")  # srun's teardown of the step, not lost
    print("srun: Force Terminated StepId=13077824.1")
    sys.exit(137)
if fails > 0:  # the last task lost, the others torn down by srun, as srun reports it
    open(os.path.join(here, "fails"), "w").write(str(fails - 1))
    print(f"srun: error: n2: task {n - 1}: Killed")
    print(f"srun: error: n1: tasks 0-{n - 2}: Terminated")
    sys.exit(137)
print("fake job done")
"""


def _under_fake_srun(tmp_path, capsys, monkeypatch, tasks: str, how: str = "task"):
    """The supervisor in an allocation of n1, n2 (``tasks``: SLURM_TASKS_PER_NODE) with
    FAKE_SRUN, whose first run fails as ``how`` says; (launches, stderr)."""
    (tmp_path / "srun.py").write_text(FAKE_SRUN)
    (tmp_path / "fails").write_text("1")
    (tmp_path / "how").write_text(how)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", tasks)
    rc = _main(["--min-np", "1", "--max-np", "4"], f"{sys.executable} {tmp_path / 'srun.py'}")
    err = capsys.readouterr().err
    assert rc == 0, err
    return [(x["args"], x["np"]) for x in _launches(tmp_path)], err


def test_srun_launches_job_steps_on_the_allocation_and_a_killed_task_costs_its_slot(
    tmp_path, capsys, monkeypatch
):
    got, err = _under_fake_srun(tmp_path, capsys, monkeypatch, "2,1")
    # capacity n1:2,n2:1 from the allocation (not localhost:4); task 2 (on n2) lost
    assert got == [
        (
            ["-n", "3", "--kill-on-bad-exit=1", "--nodelist=n1,n1,n2"]
            + ["--distribution=arbitrary", "--mpi=pmi2"],
            "3",
        ),
        (["-n", "2", "--kill-on-bad-exit=1", "--mpi=pmi2"], "2"),
    ], err
    assert "capacity from the Slurm allocation: n1:2,n2:1" in err, err
    assert "run 0 failed with exit status 137 after" in err and "rank 2 on n2" in err, err
    assert "rank 0" not in err and "rank 1 " not in err, err  # "Terminated" is not lost


def test_a_node_lost_under_srun_costs_all_its_slots_and_none_of_the_others(
    tmp_path, capsys, monkeypatch
):
    """srun's "Node failure on n2" (a node gone: its slurmd, stepd and tasks) then kills
    the tasks on n1 ("Killed"); the node is lost, n1's tasks are not. Before, each
    "Killed" task cost a slot of n1 and the node that failed kept its own: the restart
    went to the dead node."""
    got, err = _under_fake_srun(tmp_path, capsys, monkeypatch, "2(x2)", how="node")
    assert [np for _, np in got] == ["4", "2"], err
    assert got[1][0] == ["-n", "2", "--kill-on-bad-exit=1", "--mpi=pmi2"], err
    assert "run 0 failed with exit status 137" in err, err
    assert "node n2 lost (node failure): every process on it" in err, err
    assert "run 1 on 2 process(es) (n1:2)" in err, err


def test_mpi_failing_to_start_under_srun_pmi2_is_named_with_the_fix_and_costs_no_slot(
    tmp_path, capsys, monkeypatch
):
    got, err = _under_fake_srun(tmp_path, capsys, monkeypatch, "2,1", how="pmi2")
    assert [np for _, np in got] == ["3", "3"], err
    assert "srun's pmi2 mangled MPICH's long UCX addresses" in err, err
    assert "Fix: export MPIR_CVAR_CH4_NETMOD=ofi" in err, err


def test_slurm_allocation_errors_name_the_variable():
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE='2' gives 1 count"):
        _supervise.slurm_allocation({"SLURM_JOB_NODELIST": "a,b", "SLURM_TASKS_PER_NODE": "2"})
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST: expected a Slurm host list"):
        _supervise.expand_nodelist("n[1-x]")
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE: expected counts"):
        _supervise.expand_tasks_per_node("2(y3)")
    assert _supervise.launcher_kind([sys.executable, "-c", "print('slurm 23.11.4')"]) == "slurm"

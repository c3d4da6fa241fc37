"""jaxsync under a Slurm of two nodes: a slurmd on each host of the emulated cluster.

Each test is one ``python -m jaxsync cluster --hosts 2 --no-launch --no-user-namespace``
run of worker_cluster.py (munged and slurmctld on the switch, a slurmd per host; see
there): ``srun -N 2`` puts one task on each node, whose ``jaxsync.topology()`` says two
hosts as Slurm does, and trains exactly; and the restarting supervisor, in a
``salloc --no-kill`` allocation, goes on from the checkpoint on the node left when the
other is lost whole at a step (its link cut and every process on it killed: slurmd,
slurmstepd and the rank). Needs root (Slurm's daemons), Slurm and the cluster; skipped
without them, failed in CI. Every run is bounded in time.
"""

import json
import sys

import numpy as np
import pytest
from _harness import in_ci
from slurm_harness import HERE, requires_slurm
from test_slurm import STEPS, _reference

import jaxsync.cluster as jc

pytestmark = requires_slurm


@pytest.fixture(scope="module")
def cluster():
    try:
        jc.check(user_namespace=False)
    except jc.ClusterUnavailable as e:
        if in_ci():
            pytest.fail(f"CI is set but the emulated cluster cannot run: {e}", pytrace=False)
        pytest.skip(str(e))
    return jc


def _run(cluster, scenario, tmp_path, faults=()):
    r = cluster.run(
        [sys.executable, HERE / "worker_cluster.py", scenario, tmp_path],
        hosts=2,
        launch=False,
        user_namespace=False,
        link_down=faults,
        timeout=300,
        cwd=HERE,
    )
    out = tmp_path / f"{scenario}.json"
    assert out.exists(), r.output
    results = {x["name"]: x for x in json.loads(out.read_text())}
    assert "error" not in results, results["error"]["error"] + results["error"]["logs"] + r.output
    assert r.returncode == 0 and not r.timed_out, r.output
    return results, r.output


def test_srun_puts_a_task_on_each_node_and_trains_exactly(cluster, tmp_path):
    results, out = _run(cluster, "train", tmp_path)
    for name in ("topology", "train"):
        x = results[name]
        assert x["returncode"] == 0 and not x["timed_out"], x["output"] + out
    runs = [json.loads(r) for r in (tmp_path / "train" / "runs.jsonl").read_text().splitlines()]
    assert runs == [{"restart": 0, "np": 2, "start": 0}], runs
    for rank in range(2):
        got = json.loads((tmp_path / "topology" / f"rank{rank}.json").read_text())
        t, env = got["topology"], got["env"]
        assert got["hostname"] == f"host{rank}" and env["SLURM_NNODES"] == "2", got
        assert env["SLURM_JOB_NODELIST"] == "host[0-1]", env
        assert (t["rank"], t["size"]) == (rank, 2), t
        assert (t["host"], t["hosts"]) == (int(env["SLURM_NODEID"]), 2), (t, env)
        assert (t["local_rank"], t["local_size"]) == (0, 1), t
    ref = _reference([2] * STEPS)
    for rank in range(2):
        final = np.load(tmp_path / "train" / f"final-rank{rank}.npy")
        assert final.dtype == ref.dtype and final.tobytes() == ref.tobytes(), (final, ref)


def test_supervisor_goes_on_on_the_node_left_when_a_node_is_lost(cluster, tmp_path):
    lose_at = 3
    fault = jc.LinkDown(host=1, after="lose", lost=True)
    results, out = _run(cluster, "lose", tmp_path, [fault])
    x = results["supervise"]
    log = x["output"] + out
    assert x["returncode"] == 0 and not x["timed_out"], log
    assert "capacity from the Slurm allocation: host0:1,host1:1" in log, log
    assert "host1's link down for good" in log and "host1 lost" in log, log
    assert "srun: error: Node failure on host1" in log, log
    assert "node host1 lost (node failure): every process on it" in log, log
    assert "on 1 process(es) (host0:1)" in log, log
    assert results["states"]["states"] == {"host0": "idle", "host1": "down*"}, results
    runs = [json.loads(r) for r in (tmp_path / "train" / "runs.jsonl").read_text().splitlines()]
    assert runs == [
        {"restart": 0, "np": 2, "start": 0},
        {"restart": 1, "np": 1, "start": lose_at},
    ], log
    final = np.load(tmp_path / "train" / "final-rank0.npy")
    ref = _reference([2] * lose_at + [1] * (STEPS - lose_at))
    assert final.dtype == ref.dtype and final.tobytes() == ref.tobytes(), (final, ref)
    assert not np.array_equal(ref, _reference([2] * STEPS))
    assert not (tmp_path / "train" / "final-rank1.npy").exists()

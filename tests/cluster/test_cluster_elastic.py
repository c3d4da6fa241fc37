"""``python -m jaxsync elastic`` in the emulated cluster: a host is lost, the job goes on.

One supervised job (numpy and mpi4py, ``worker_elastic_cluster.py``) on 3 hosts x 2
processes, the cluster run with ``launch=False`` so that the supervisor launches by
itself with ``$JAXSYNC_CLUSTER_MPIRUN`` and discovers hosts from
``$JAXSYNC_CLUSTER_HOSTFILE``. When host 2's processes reach step 5 they mark it, and
the cluster's fault ``LinkDown(2, after="lose-host", lost=True)`` cuts host 2's link
and kills every process on it (hydra's mpirun then waits for ever: the supervisor's
discovery, asked during the run, ends the run). The discovery script deletes host 2's
folder (its checkpoint) before the restart, which runs on hosts 0 and 1 from their own
checkpoints; the final parameters equal bitwise the closed form: steps 0-4 averaged
over six ranks, steps 5-7 over four.
"""

from __future__ import annotations

import json
import re
import sys

import numpy as np
from cluster_harness import HERE, worker_env

import jaxsync

PY = sys.executable
W = HERE / "worker_elastic_cluster.py"
STEPS, KILL_AT, LR = 8, 5, 0.5


def _c(t):
    return np.array([t + 1, 0.5, -(t % 3), 0.25], dtype=np.float64)


def _reference():
    w = np.zeros(4)
    for t in range(STEPS):  # sum of (rank + 1) over 6 ranks is 21, over 4 it is 10
        w = w - LR * ((21 * _c(t)) / 6 if t < KILL_AT else (10 * _c(t)) / 4)
    return w


def test_a_lost_host_restarts_on_the_hosts_left_from_their_checkpoints(cluster, tmp_path):
    sup = (
        f"exec {PY} -m jaxsync elastic --min-np 2 --max-np 6 --max-restarts 1 "
        '--discovery-interval 1 --mpirun "$JAXSYNC_CLUSTER_MPIRUN" '
        f'--host-discovery-script "{PY} {W} discover {tmp_path}" -- {PY} {W} train {tmp_path}'
    )
    r = cluster.run(
        ["sh", "-c", sup],
        hosts=3,
        procs_per_host=2,
        launch=False,
        link_down=[jaxsync.cluster.LinkDown(host=2, after="lose-host", lost=True)],
        env=worker_env(host_tier=None),
        timeout=120,
    )
    assert not r.timed_out, r.output
    assert r.returncode == 0, r.output
    killed = re.search(r"host2's link down for good .*host2 lost: (\d+) process", r.output)
    assert killed and int(killed.group(1)) >= 2, r.output  # its 2 ranks (and its proxy)
    assert "run 0 failed" in r.output and "host(s) host2 no longer discovered" in r.output
    assert "run 1 on 4 process(es) (host0:2,host1:2)" in r.output, r.output
    runs = [json.loads(x) for x in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert runs == [
        {"restart": 0, "np": 6, "starts": [[0, 0], [1, 0], [2, 0]]},
        {"restart": 1, "np": 4, "starts": [[0, KILL_AT], [1, KILL_AT]]},
    ], r.output
    assert not (tmp_path / "host2").exists()  # the lost host took its files with it
    final, ref = np.load(tmp_path / "final.npy"), _reference()
    assert final.dtype == ref.dtype and final.tobytes() == ref.tobytes(), (final, ref)
    # the wrong anchors give other values: all steps on 6 ranks, or all on 4
    assert not np.array_equal(ref, -LR * 3.5 * sum(_c(t) for t in range(STEPS)))
    assert not np.array_equal(ref, -LR * 2.5 * sum(_c(t) for t in range(STEPS)))


def test_a_lost_host_and_no_launch_are_options_checked_when_made():
    import pytest

    from jaxsync.cluster import cli

    with pytest.raises(ValueError, match="LinkDown.lost must be a bool, got 'yes'"):
        jaxsync.cluster.LinkDown(host=2, after="x", lost="yes")
    a = cli.parse(["--hosts", "3", "--lose-host", "2@x+4", "--no-launch", "--", "sh", "s"])
    assert (a.launch, a.link_down) == (False, [jaxsync.cluster.LinkDown(2, 0.0, 4.0, "x", True)])
    assert cli.parse(["--", "true"]).launch is True

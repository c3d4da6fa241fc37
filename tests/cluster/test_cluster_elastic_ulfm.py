"""In-process ULFM recovery (``jaxsync.elastic.run``) in the emulated cluster.

Open MPI's ``mpirun`` (the ft environment's, ``.venv-ft``) launches across the
cluster's hosts: the cluster runs it with ``launch=False``, and PRRTE starts its
daemon on each host through the cluster's ssh stand-in (``--prtemca plm_ssh_agent
$JAXSYNC_CLUSTER_SSH``), out-of-band and MPI traffic on the cluster's subnet, one
process per host (``--map-by ppr:1:node``). The workers are the MPI suite's
(``tests/mpi/worker_elastic_inprocess.py``: four models, ``sharded``, double
buffering and overlap among them, a commit per step) and its reference
(``test_elastic_ulfm._check_bitwise``):

- host 2's process killed (SIGKILL) at step 3: its daemon sees it end, the survivors
  recover at once;
- host 2's link cut for good at step 3 (the process alive, silent): only Open MPI's
  heartbeat detector sees it (``--mca mpi_ft_detector true``, a heartbeat every
  0.5 s, suspected after 2 s; off by default). ``mpirun`` itself then waits for ever
  for that host's daemon, so the run ends when the survivors have written their
  records.

The survivors finish with parameters equal bitwise to steps 0-2 on three ranks and
3-5 on two. Skipped without the ft environment, as ``tests/mpi/test_elastic_ulfm.py``.
"""

from __future__ import annotations

import json
import shlex

import test_elastic_ulfm as ulfm
from cluster_harness import HERE, MPI_DIR, worker_env
from test_elastic_ulfm import _ft_present  # noqa: F401 - the fixture of ulfm.requires_ft

import jaxsync

DETECTOR = ["--mca", "mpi_ft_detector", "true", "--mca", "mpi_ft_detector_period", "0.5"]
DETECTOR += ["--mca", "mpi_ft_detector_timeout", "2"]


def _run(cluster, tmp_path, worker, extra=(), faults=()):
    ft = ulfm.FT_VENV / "bin"
    out = tmp_path / "out"
    out.mkdir(parents=True)
    (tmp_path / "tmp").mkdir()  # PRRTE's session folders: PIDs repeat in each cluster
    line = [str(ft / "mpirun"), "--with-ft", "ulfm", "--allow-run-as-root", "-n", "3"]
    line += ["--host", "host0:1,host1:1,host2:1", "--map-by", "ppr:1:node:OVERSUBSCRIBE"]
    line += ["--prtemca", "oob_tcp_if_include", "10.233.0.0/24", "--mca", "btl", "tcp,self"]
    line += ["--mca", "btl_tcp_if_include", "10.233.0.0/24", *extra]
    line += [str(ft / "python"), str(worker), str(out)]
    agent = '--prtemca plm_ssh_agent "$JAXSYNC_CLUSTER_SSH"'
    done = " ".join(f"[ -e {out}/rank-{r}.json ]" for r in (0, 1)).replace("] [", "] && [")
    script = (  # the survivors' records are the job's end (mpirun may wait on a lost host)
        f"{shlex.join(line[:1])} {agent} {shlex.join(line[1:])} & "
        f"until {done}; do kill -0 $! 2>/dev/null || exit 1; sleep 0.2; done; sleep 1"
    )
    env = {k: v for k, v in worker_env(host_tier=None).items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(HERE.parents[1]), TMPDIR=str(tmp_path / "tmp"))
    env["OMP_NUM_THREADS"] = "1"
    r = cluster.run(
        ["sh", "-c", script], hosts=3, launch=False, link_down=faults, env=env, timeout=120
    )
    assert not r.timed_out, r.output
    recs = {int(f.stem.split("-")[1]): json.loads(f.read_text()) for f in out.glob("rank-*")}
    assert sorted(recs) == [0, 1], f"survivors' records: {sorted(recs)}\n{r.output}"
    ulfm._check_bitwise(recs, 2, r.output)
    for rank, rec in recs.items():
        assert (rec["rank"], rec["size"], rec["recoveries"]) == (rank, 2, 1), rec
        assert rec["recovery_s"]["restored_commit"] == 4, rec
        assert rec["seen"] == {"topology": [rank, 2], "broadcast": 0.0}, rec
    return recs, r


@ulfm.requires_ft
def test_ulfm_recovery_across_hosts_a_killed_process_and_a_link_cut(cluster, tmp_path):
    _run(cluster, tmp_path / "kill", MPI_DIR / "worker_elastic_inprocess.py")
    cut = jaxsync.cluster.LinkDown(host=2, after="cut")  # for good, the process alive
    _, r = _run(
        cluster, tmp_path / "cut", HERE / "worker_elastic_ulfm_cut.py", DETECTOR, faults=[cut]
    )
    assert "host2's link down for good (0 s after marker 'cut')" in r.output, r.output

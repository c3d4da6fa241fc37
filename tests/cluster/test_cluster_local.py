"""jaxsync.local across the emulated cluster: 2 hosts x 2 processes, an island a
host (``islands="host"``), the outer mean over the shaped link. The records of
tests/mpi/worker_local_sliced.py (DiLoCo and streaming with the anchor whole and
sliced over the island's 2 processes, streaming's mean in flight across jitted
steps), checked as under mpirun: bitwise; and a process of one host's island
that disagrees on ``every``: the same error on all four."""

from __future__ import annotations

import pickle

from cluster_harness import MPI_DIR, worker_env

PY = __import__("sys").executable


def test_local_updates_across_2_hosts(cluster, tmp_path):
    from test_local_mpi import check_disagreement, check_sliced

    cmd = [PY, MPI_DIR / "worker_local_sliced.py", "--out", tmp_path, "--islands", "host"]
    r = cluster.run(cmd, hosts=2, procs_per_host=2, env=worker_env(None), timeout=300)
    assert r.returncode == 0, r.output
    results = [pickle.loads((tmp_path / f"rank{k}.pkl").read_bytes()) for k in range(4)]
    check_sliced(results)
    check_disagreement(results)

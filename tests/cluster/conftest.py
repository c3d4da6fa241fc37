"""tests/cluster: tests inside the emulated cluster (``jaxsync.cluster``).

Each test runs its programs under ``jaxsync.cluster.run`` with a time limit, so a
hang fails the test. The workers are the MPI suite's (``tests/mpi``) and a few of
this folder's own; pytest never imports them. Helpers: ``cluster_harness.py``.
"""

from cluster_harness import cluster  # noqa: F401 - the fixture

collect_ignore_glob = ["worker_*.py"]

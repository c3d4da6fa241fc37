"""tests/mpi: multi-process tests (helpers in mpi_harness.py)."""

# Worker scripts run under mpirun; pytest (--doctest-modules) must not import them.
collect_ignore_glob = ["worker_*.py", "_worker.py"]

"""tests/mpi: multi-process tests (helpers in mpi_harness.py)."""

# Worker scripts run under mpirun; pytest (--doctest-modules) must not import them.
collect_ignore_glob = ["worker_*.py", "_worker.py"]

from mpi_harness import _mpi_required_in_ci  # noqa: E402,F401 - used by requires_mpi in CI

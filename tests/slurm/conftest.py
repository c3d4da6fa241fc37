"""tests/slurm: jaxsync under a real Slurm (helpers in slurm_harness.py)."""

import pytest

# Worker scripts run under srun; pytest (--doctest-modules) must not import them.
collect_ignore_glob = ["worker_*.py"]

from slurm_harness import MISSING, Slurm, missing  # noqa: E402


@pytest.fixture(scope="module")
def slurm():
    """A private Slurm (munged, slurmctld, one slurmd) for the module, stopped after it."""
    if missing():
        pytest.skip(MISSING)  # the tests' requires_slurm mark fails it in CI first
    cluster = Slurm().start()
    try:
        yield cluster
    finally:
        cluster.stop()

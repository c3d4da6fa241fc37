"""tests/slurm: jaxsync under a real Slurm (helpers in slurm_harness.py)."""

import pytest
from _harness import in_ci

# Worker scripts run under srun; pytest (--doctest-modules) must not import them.
collect_ignore_glob = ["worker_*.py"]

from slurm_harness import (  # noqa: E402
    MISSING,
    Slurm,
    _slurm_required_in_ci,  # noqa: F401 - used by requires_slurm in CI
    missing,
)


@pytest.fixture(scope="module")
def slurm():
    """A private Slurm (munged, slurmctld, one slurmd) for the module, stopped after it.

    Without Slurm: a skip naming scripts/setup_slurm.sh, a failure in CI (``CI`` set).
    (Checked here too: a module fixture is set up before the marks' function ones.)
    """
    if missing():
        if in_ci():
            pytest.fail(f"CI is set (scripts/test.sh installs it) but {MISSING}", pytrace=False)
        pytest.skip(MISSING)
    cluster = Slurm().start()
    try:
        yield cluster
    finally:
        cluster.stop()

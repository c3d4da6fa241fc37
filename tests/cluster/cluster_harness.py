"""Helpers of the cluster tests: the ``cluster`` fixture and the ranks' environment."""

import os
import sys
from pathlib import Path

import pytest
from _harness import in_ci

HERE = Path(__file__).resolve().parent
MPI_DIR = HERE.parent / "mpi"
if str(MPI_DIR) not in sys.path:
    sys.path.insert(0, str(MPI_DIR))


@pytest.fixture(scope="session")
def cluster():
    """``jaxsync.cluster``, or a skip (a failure in CI) where it cannot run here."""
    import jaxsync.cluster

    try:
        jaxsync.cluster.check()
    except jaxsync.cluster.ClusterUnavailable as e:
        if in_ci():
            pytest.fail(f"CI is set but the emulated cluster cannot run: {e}", pytrace=False)
        pytest.skip(str(e))
    return jaxsync.cluster


def worker_env(host_tier: bool | None = True) -> dict:
    """The ranks' environment: this checkout and tests/mpi importable, no XLA_FLAGS,
    the host tier forced on (``JAXSYNC_HOST_TIER=1``), off (``host_tier=False``:
    ``0``) or left to the transforms' ``host_tier`` option (``None``: unset)."""
    env = dict(os.environ)
    env.pop("JAXSYNC_HOST_TIER", None)
    if host_tier is not None:
        env["JAXSYNC_HOST_TIER"] = "1" if host_tier else "0"
    root = HERE.parent.parent
    env["PYTHONPATH"] = os.pathsep.join(
        [str(root), str(MPI_DIR), str(HERE)]
        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env.pop("XLA_FLAGS", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env

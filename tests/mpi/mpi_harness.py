"""Launch MPI worker scripts under mpirun from pytest.

``run_mpi(script, n=2, devices=2, args=(), timeout=120)`` starts
``mpirun -n N python tests/mpi/SCRIPT --out DIR --devices D ARGS...`` in its
own process group, kills the whole group if it runs past ``timeout`` (a hang
fails the test instead of blocking the suite), and returns an :class:`MPIRun`
with the exit code, the combined output and each rank's recorded results.
``devices`` may be a comma list ("2,4"): one local device count per rank.

Without mpirun (next to the interpreter, or ``JAXSYNC_MPIRUN``), mpi4py or
mpi4jax the suite is skipped - except when the ``CI`` environment variable is
set, where it fails.
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest
from _harness import Run, requirement, run_in_group

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
MPIRUN = Path(os.environ.get("JAXSYNC_MPIRUN") or Path(sys.executable).parent / "mpirun")


def _have_mpi() -> bool:
    # find_spec, not import: importing mpi4jax would initialise MPI in the pytest
    # process (mpi4py.MPI), which changes jaxsync's comm="auto" for other tests.
    import importlib.util

    return MPIRUN.exists() and all(
        importlib.util.find_spec(m) is not None for m in ("mpi4py", "mpi4jax")
    )


_MISSING = f"needs mpirun at {MPIRUN}, mpi4py and mpi4jax"

# CI must run the multi-process suite: a missing MPI is a failure there.
requires_mpi = requirement(not _have_mpi(), _MISSING, "_mpi_required_in_ci")


@pytest.fixture
def _mpi_required_in_ci():
    pytest.fail(f"CI is set but the MPI suite cannot run: {_MISSING}", pytrace=False)


class MPIRun(Run):
    def __init__(self, cmd, returncode, output, results, elapsed, timed_out):
        super().__init__(cmd, returncode, output, elapsed, timed_out)
        self.results = results  # one dict per rank (None: rank wrote nothing)

    def check(self) -> MPIRun:
        """Fail unless every rank exited 0 and wrote its results."""
        if self.timed_out or self.returncode != 0:
            pytest.fail("MPI job failed:\n" + self.describe(), pytrace=False)
        missing = [r for r, res in enumerate(self.results) if res is None]
        if missing:
            pytest.fail(f"ranks {missing} wrote no results:\n" + self.describe(), pytrace=False)
        return self


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(HERE)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    # Workers choose their own device count; do not inherit the pytest process's.
    env.pop("XLA_FLAGS", None)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_command(cmd: list, timeout: float, env: dict | None = None) -> tuple[int, str, bool]:
    """Run ``cmd`` (e.g. ``mpirun -n 2 ...``) in its own process group; returns
    ``(returncode, output, timed_out)`` and never blocks past ``timeout``: on
    timeout the whole group (mpirun and its ranks) is killed."""
    return run_in_group(cmd, timeout, _env() if env is None else env, ROOT)


def run_bench(args, timeout: float) -> tuple[int, str, bool]:
    """``mpirun -n 2 python -m jaxsync bench ARGS`` as :func:`run_command` runs it, with
    this checkout on the path and no ``XLA_FLAGS`` (the benchmark sets its device count)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [MPIRUN, "-n", "2", sys.executable, "-m", "jaxsync", "bench", *args]
    return run_command(cmd, timeout, env)


def run_mpi(script, n=2, devices=2, args=(), timeout=120, out=None, env=None) -> MPIRun:
    """Run ``tests/mpi/SCRIPT`` under ``mpirun -n N``; never blocks past ``timeout``.
    ``env``: variables set for the ranks on top of the test's environment."""
    own = out is None
    out = Path(tempfile.mkdtemp(prefix="jaxsync-mpi-")) if own else Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(MPIRUN),
        "-n",
        str(n),
        sys.executable,
        str(HERE / script),
        "--out",
        str(out),
        "--devices",
        str(devices),
        *map(str, args),
    ]
    t0 = time.monotonic()
    returncode, output, timed_out = run_command(
        cmd, timeout, None if env is None else {**_env(), **env}
    )
    elapsed = time.monotonic() - t0
    results = []
    for r in range(n):
        p = out / f"rank{r}.pkl"
        results.append(pickle.loads(p.read_bytes()) if p.exists() else None)
    if own:
        shutil.rmtree(out, ignore_errors=True)
    return MPIRun(cmd, returncode, output, results, elapsed, timed_out)

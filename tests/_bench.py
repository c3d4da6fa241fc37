"""The benchmark smoke tests' child process: ``python -m MODULE ARGS`` from the checkout.

The benchmark runs in a subprocess so that its device count does not depend on the
pytest process, which already has 8 devices: without ``XLA_FLAGS`` and without an
MPI launcher's variables (the child is not started by mpirun, and one that inherits
them would try to join an MPI job).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_MPI_ENV = ("PMI_", "PMIX_", "OMPI_", "HYDI_", "HYDRA_", "MPI_LOCAL", "MV2_")


def run_module(*args, timeout: float) -> subprocess.CompletedProcess:
    """Run ``python -m ARGS`` in the checkout, its output captured as text."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith(_MPI_ENV)}
    return subprocess.run(
        [sys.executable, "-m", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )

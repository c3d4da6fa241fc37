"""scripts/setup_slurm.sh: a no-op where Slurm is there, a named failure where a step fails.

The install itself (apt-get) is not run here: a stand-in apt-get fails, and
``JAXSYNC_SLURM_PROGRAMS`` names a program no machine has, so the script goes on to
install. tests/slurm is where the installed Slurm is used.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "setup_slurm.sh"


def _run(tmp_path, **env):
    full = dict(os.environ, JAXSYNC_SLURM_LOG=str(tmp_path / "setup.log"), **env)
    return subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60, env=full
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="not root: the script stops before apt-get")
def test_a_failed_step_fails_naming_it_and_its_output(tmp_path):
    fake = tmp_path / "apt-get"
    fake.write_text("#!/bin/sh\necho 'E: stand-in apt-get failed on purpose' >&2\nexit 100\n")
    fake.chmod(0o755)
    r = _run(tmp_path, JAXSYNC_SLURM_APT_GET=str(fake), JAXSYNC_SLURM_PROGRAMS="no-such-program-x")
    assert r.returncode == 100, (r.returncode, r.stdout, r.stderr)
    assert "[setup-slurm] FAILED: apt-get update (exit status 100)" in r.stderr, r.stderr
    assert "E: stand-in apt-get failed on purpose" in r.stderr, r.stderr
    assert "stand-in apt-get failed" in (tmp_path / "setup.log").read_text()


@pytest.mark.skipif(shutil.which("srun") is None, reason="Slurm not installed here")
def test_a_second_run_does_nothing_where_slurm_is_installed(tmp_path):
    r = _run(tmp_path)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", ""), (r.stdout, r.stderr)
    assert not (tmp_path / "setup.log").exists()

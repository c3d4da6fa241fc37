#!/usr/bin/env bash
# Run the whole test suite (sets everything up first): lint, format and type
# checks, the docs build, then pytest. Extra args go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${JAXSYNC_VENV:-$root/.venv}"
bash "$root/scripts/setup.sh"
# The fault-tolerant MPI environment (.venv-ft: Open MPI 5 with ULFM) for the elastic
# tests: a second venv, so the default mpich one stays as it is.
bash "$root/scripts/setup_ft.sh"
# Slurm (Debian's slurm-wlm and munge, apt-get) for tests/slurm, which start a private
# munged + slurmctld + slurmd of their own; a no-op where it is installed.
bash "$root/scripts/setup_slurm.sh"
cd "$root"
export PATH="$venv/bin:$PATH"
echo "[test] ruff check, ruff format --check, mypy (config in pyproject.toml)"
"$venv/bin/ruff" check --no-cache .
"$venv/bin/ruff" format --no-cache --check .
"$venv/bin/mypy" --cache-dir "$venv/.mypy_cache"
# The documentation site (mkdocs.yml), warnings as errors, into a folder of its own
# (site/ is git-ignored; mkdocs serve for a live preview). Not --quiet: mkdocs counts
# only the warnings it prints, so --strict --quiet passes a broken link.
echo "[test] mkdocs build --strict"
site="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 "$venv/bin/mkdocs" build --strict --site-dir "$site" \
  || { rm -rf "$site"; exit 1; }
rm -rf "$site"
# Extra args: one pytest run with them (e.g. a file, -k). Else the whole suite in two
# runs: the in-process tests on 2 workers (pytest-xdist; each keeps about one core
# busy), then the multi-process ones (mpirun, the emulated cluster, jax.distributed, Slurm)
# one at a time, alone on the machine as their ranks need. Both run; either failing
# fails the suite.
if [ "$#" -gt 0 ]; then
  exec "$venv/bin/python" -m pytest -q "$@"
fi
workers="${JAXSYNC_TEST_WORKERS:-2}"
multi=(tests/mpi tests/cluster tests/distributed tests/slurm)
rc=0
echo "[test] pytest: in-process tests, $workers workers"
"$venv/bin/python" -m pytest -q -n "$workers" tests jaxsync notebooks \
  "${multi[@]/#/--ignore=}" || rc=$?
echo "[test] pytest: multi-process tests, one at a time"
"$venv/bin/python" -m pytest -q "${multi[@]}" || rc=$?
# The matrix job: current JAX (jax 0.12 on Python 3.12 or 3.13, its own environment
# .venv-jax12), the core in-process tests and a few mpirun ones. JAXSYNC_SKIP_JAX12=1
# leaves it out; a machine with no Python 3.12/3.13 fails it, saying what is missing.
if [ "${JAXSYNC_SKIP_JAX12:-0}" != 1 ]; then
  echo "[test] the jax 0.12 job (scripts/test_jax12.sh)"
  bash "$root/scripts/test_jax12.sh" || rc=$?
fi
exit "$rc"

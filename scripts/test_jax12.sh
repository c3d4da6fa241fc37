#!/usr/bin/env bash
# The smaller matrix job: jaxsync on current JAX (jax 0.12, CPU) with Python 3.12
# (or 3.13, which jax 0.11-0.12 need: >= 3.12). Builds its own environment
# (.venv-jax12, with jaxsync's native MPI target compiled for that interpreter, beside
# the default one's) through scripts/setup.sh, then runs the in-process tests of the
# strategies, the transforms, local updates, the quantized wire and the native
# target, and a few mpirun tests. Extra args go to pytest in place of that list.
#
# Environment (optional):
#   JAXSYNC_PY312   the interpreter (default: the first Python 3.12, then 3.13, found
#                   on PATH or in pyenv's versions)
#   JAXSYNC_JAX     the jax requirement (default: jax[cpu]==0.12.*)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
want_version() {  # $1: interpreter; true if it runs and is 3.12 or 3.13
  "$1" -c 'import sys; sys.exit(0 if sys.version_info[:2] in ((3, 12), (3, 13)) else 1)' \
    >/dev/null 2>&1
}
candidates=()
[ -n "${JAXSYNC_PY312:-}" ] && candidates+=("$JAXSYNC_PY312")
pyenv_root="${PYENV_ROOT:-$HOME/.pyenv}"
command -v pyenv >/dev/null 2>&1 && pyenv_root="$(pyenv root)"
for minor in 12 13; do
  command -v "python3.$minor" >/dev/null 2>&1 && candidates+=("$(command -v "python3.$minor")")
  for p in $(ls -d "$pyenv_root"/versions/3."$minor".*/bin/python3."$minor" 2>/dev/null | sort -V -r); do
    candidates+=("$p")
  done
done
py=""
for c in "${candidates[@]}"; do
  if want_version "$c"; then py="$c"; break; fi
done
if [ -z "$py" ]; then
  echo "[test-jax12] no Python 3.12 or 3.13 found (tried: \$JAXSYNC_PY312, python3.12 and" >&2
  echo "  python3.13 on PATH, $pyenv_root/versions/3.1[23].*). jax 0.11-0.12 need Python" >&2
  echo "  >= 3.12. Fix: pyenv install 3.12 (or set JAXSYNC_PY312=/path/to/python3.12)." >&2
  exit 1
fi
venv="$root/.venv-jax12"
echo "[test-jax12] $("$py" -V) at $py; environment $venv"
JAXSYNC_VENV="$venv" PYTHON="$py" JAXSYNC_JAX="${JAXSYNC_JAX:-jax[cpu]==0.12.*}" \
  bash "$root/scripts/setup.sh"
export PATH="$venv/bin:$PATH"
"$venv/bin/python" -c 'import jax, sys; print(f"[test-jax12] jax {jax.__version__}, Python {sys.version.split()[0]}")'
if [ "$#" -gt 0 ]; then
  exec "$venv/bin/python" -m pytest -q "$@"
fi
rc=0
"$venv/bin/python" -m pytest -q -n "${JAXSYNC_TEST_WORKERS:-2}" \
  tests/test_strategies.py tests/test_transforms.py tests/test_local.py \
  tests/test_quant_sync.py tests/test_native.py tests/test_imports.py || rc=$?
"$venv/bin/python" -m pytest -q tests/mpi/test_local_mpi.py tests/mpi/test_control_flow_mpi.py || rc=$?
"$venv/bin/python" -m pytest -q tests/mpi/test_mpi.py -k "native or watchdog or exact" || rc=$?
exit $rc

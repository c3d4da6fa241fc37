#!/usr/bin/env bash
# Create (or reuse) .venv in the checkout and install jaxsync with MPI, tests and
# benchmark extras. Needs only python3 (>= 3.10). A second run skips finished work.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
py="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv"
  "$py" -m venv "$venv"
fi
export PATH="$venv/bin:$PATH"
stamp="$venv/.jaxsync-setup"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@" 2>&1 | grep -v "is ignored: it is neither" || true; }
echo "[setup] installing build tools, jax, MPI (mpich wheel) and mpi4py"
pip install --upgrade pip setuptools wheel nanobind
pip install "jax[cpu]>=0.10,<0.11" "mpich>=4" "mpi4py>=4.0"
# mpi4jax builds from source: it needs mpicc (from the mpich wheel, now on PATH),
# mpi4py + nanobind + setuptools + wheel without build isolation, and - on
# machines with a CUDA toolkit lacking headers - CUDA_ROOT at an empty folder
# for a CPU-only build.
if ! "$venv/bin/python" -c "import mpi4jax" >/dev/null 2>&1; then
  echo "[setup] building mpi4jax from source (about 30 s)"
  command -v mpicc >/dev/null || { echo "mpicc not found on PATH" >&2; exit 1; }
  if [ -z "${CUDA_ROOT:-}" ] && ! [ -f /usr/local/cuda/include/cuda_runtime.h ]; then
    export CUDA_ROOT="$venv/.no-cuda"; mkdir -p "$CUDA_ROOT"
  fi
  pip install --no-build-isolation --no-binary mpi4jax "mpi4jax>=0.9,<0.10"
fi
echo "[setup] installing jaxsync (editable) with mpi, test, bench and demo extras"
pip install --no-build-isolation -e ".[mpi,test,bench,demo]"
"$venv/bin/python" -c "import jax, optax, mpi4py, mpi4jax, jaxsync; print('[setup] ok: jax', jax.__version__, 'mpi4jax', mpi4jax.__version__)"
echo "$want" > "$stamp"

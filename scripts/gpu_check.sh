#!/usr/bin/env bash
# The GPU path checked for real (issue 46, item 18): run it when a GPU machine is
# lent. Needs jax with CUDA and mpi4jax built with its CUDA extension in the venv
# (JAXSYNC_VENV, default .venv), and mpirun. Two processes share the GPUs there are
# (one GPU: both on GPU 0, memory not preallocated). Three parts, each timed out:
#   1. python -m jaxsync selftest under mpirun -n 2, staged through host memory
#      (MPI4JAX_USE_CUDA_MPI=0, what the README's mpich wheel needs);
#   2. scripts/gpu_check.py: every strategy bitwise against the closed form, and
#      each one's time against mpi4jax's bare allreduce of the same bytes;
#   3. part 2 again with MPI4JAX_USE_CUDA_MPI=1 if GPU_CHECK_CUDA_MPI=1 (a
#      CUDA-aware MPI only: with another MPI expect a crash or wrong sums).
# Prints PASS/FAIL per part; the exit status is non-zero when any part failed.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${JAXSYNC_VENV:-$root/.venv}"
cd "$root"
export PATH="$venv/bin:$PATH" PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda
ngpu="$(python -c 'import jax; print(jax.local_device_count())' 2>/dev/null || echo 0)"
[ "$ngpu" -ge 1 ] || { echo "gpu_check: no CUDA device visible to jax"; exit 2; }
python -c 'from mpi4jax._src.xla_bridge import HAS_CUDA_EXT as h; assert h' \
  || { echo "gpu_check: mpi4jax has no CUDA extension (rebuild it with CUDA)"; exit 2; }
# Each rank its own GPU where there are two or more, else both on GPU 0.
wrap='export CUDA_VISIBLE_DEVICES=$(( ${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}} % '"$ngpu"' )); exec "$@"'
launch() { timeout "$1" mpirun -n 2 bash -c "$wrap" _ "${@:2}"; }
failed=0
part() {
  local name="$1"; shift
  echo "=== gpu_check: $name"
  if "$@"; then echo "=== PASS: $name"; else echo "=== FAIL: $name"; failed=1; fi
}
part "selftest, staged through host" env MPI4JAX_USE_CUDA_MPI=0 \
  launch 300 python -m jaxsync selftest --mbytes 16 --iters 5
part "strategies bitwise, timings (staged)" env MPI4JAX_USE_CUDA_MPI=0 \
  launch 300 python scripts/gpu_check.py
if [ "${GPU_CHECK_CUDA_MPI:-0}" = 1 ]; then
  part "strategies bitwise, timings (CUDA-aware MPI)" env MPI4JAX_USE_CUDA_MPI=1 \
    launch 300 python scripts/gpu_check.py
fi
exit "$failed"

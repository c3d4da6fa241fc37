#!/usr/bin/env bash
# The GPU path checked on a bare GPU machine with no network (the `device` tool's):
# its preinstalled jax (0.11/0.12, CUDA 13) is used as it is; MPI, mpi4py and
# mpi4jax come from .gpu_carry/ (scripts/gpu_carry.sh fetches them beforehand), and
# mpi4jax is built there from its sdist with its CUDA bridge. Then, under
# `mpirun -n 2` on the one GPU (memory not preallocated), each part timed out:
#   1. python -m jaxsync selftest, staged through host memory (MPI4JAX_USE_CUDA_MPI=0,
#      what the mpich wheel needs);
#   2. scripts/gpu_check.py: every strategy exact (blocking and overlap=True), double
#      buffering, a quantized wire, sharded, broadcast_params, local_sgd, then times
#      against the bare mpi4jax allreduce and XLA's psum; a table in OUT/gpu_check.md;
#   3. part 2 again with MPI4JAX_USE_CUDA_MPI=1 if GPU_CHECK_CUDA_MPI=1 (a CUDA-aware
#      MPI only).
# Usage: bash scripts/gpu_check.sh [OUT]   (OUT default: gpu-check-results/; the
# device call passes $OUT). About 4 minutes on one H100 (set-up 1-2, checks 2), bounded
# at 9 by the parts' timeouts. Variables: GPU_CHECK_PYTHON (default python3: the
# image's), GPU_CHECK_CARRY (.gpu_carry), GPU_CHECK_PLATFORM (cuda; cpu: the dry run
# on a machine without GPU, through mpi4jax's CPU bridge, as tests/mpi does).
# Prints PASS/FAIL per part; the exit status is non-zero when any part failed.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root/gpu-check-results}"
carry="${GPU_CHECK_CARRY:-$root/.gpu_carry}"
py="${GPU_CHECK_PYTHON:-python3}"
platform="${GPU_CHECK_PLATFORM:-cuda}"
env="${GPU_CHECK_ENV:-/tmp/jaxsync-gpu-env}"
mkdir -p "$out"
log="$out/gpu_check.log"
: >"$log"
say() { echo "$*" | tee -a "$log"; }
die() { say "gpu_check: $*"; exit 2; }
run() { "$@" >>"$log" 2>&1 || { tail -n 30 "$log"; return 1; }; }
started=$SECONDS
for want in 'mpi4jax-*.tar.gz' 'mpich-*.whl' 'mpi4py-*.whl'; do
  compgen -G "$carry/$want" >/dev/null ||
    die "$want not in $carry: run 'bash scripts/gpu_carry.sh' first, and carry .gpu_carry"
done

# An environment over the image's packages (its jax, optax, numpy, setuptools,
# nanobind): a venv whose .pth file adds the image's site-packages behind its own,
# so that what is installed here (mpich, mpi4py, mpi4jax, jaxsync) comes first.
image_site="$("$py" -c 'import jax, os; print(os.path.dirname(os.path.dirname(jax.__file__)))')" ||
  die "$py cannot import jax (GPU_CHECK_PYTHON names the image's Python)"
rm -rf "$env"
if "$py" -m venv "$env" >>"$log" 2>&1; then
  pip=("$env/bin/python" -m pip)
else  # no ensurepip in the base Python: the image's pip, aimed at the environment
  "$py" -m venv --without-pip "$env" >>"$log" 2>&1 || die "cannot make a venv with $py"
  pip=("$py" -m pip --python "$env/bin/python")
fi
site="$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$image_site" >"$site/_gpu_check_image.pth"
export PATH="$env/bin:$PATH" XLA_PYTHON_CLIENT_PREALLOCATE=false PIP_NO_INDEX=1
export PIP_DISABLE_PIP_VERSION_CHECK=1 OMP_NUM_THREADS=1
if [ "$platform" = cpu ]; then
  export JAX_PLATFORMS=cpu JAXSYNC_TESTING_MPI4JAX=1
else
  export JAX_PLATFORMS=cuda
fi
say "=== gpu_check: $("$env/bin/python" -c 'import jax, sys; print(f"Python {sys.version.split()[0]}, jax {jax.__version__}, {jax.default_backend()}: {jax.devices()[0].device_kind} x {jax.local_device_count()}")' 2>>"$log")" ||
  die "jax sees no $platform device (see $log)"

say "--- set-up: mpich and mpi4py wheels"
run "${pip[@]}" install --no-deps --find-links "$carry" "mpich>=4" "mpi4py>=4.0" || die "install failed"
cuda_root="$env/.no-cuda"
if [ "$platform" = cpu ]; then
  mkdir -p "$cuda_root"
else
  cuda_root="$("$env/bin/python" "$root/jaxsync/_cli/_toolkit.py" cuda-root)" || die "no CUDA toolkit headers"
fi
say "--- set-up: mpi4jax from its sdist (CUDA root: $cuda_root)"
CUDA_PATH="$cuda_root" CUDA_ROOT="$cuda_root" MPI4JAX_BUILD_MPICC="$env/bin/mpicc" \
  run "${pip[@]}" install --no-build-isolation --no-deps --no-cache-dir "$carry"/mpi4jax-*.tar.gz ||
  die "mpi4jax did not build"
if [ "$platform" != cpu ]; then
  "$env/bin/python" -c 'from mpi4jax._src.xla_bridge import HAS_CUDA_EXT as h; assert h' >>"$log" 2>&1 ||
    die "mpi4jax built without its CUDA bridge (see $log)"
fi
say "--- set-up: jaxsync (with its native target) from this checkout"
MPICC="$env/bin/mpicc" JAXSYNC_REQUIRE_NATIVE=1 \
  run "${pip[@]}" install --no-build-isolation --no-deps -e "$root" || die "jaxsync did not install"
say "--- set-up done in $((SECONDS - started)) s"

failed=0
part() {
  local name="$1" limit="$2"
  shift 2
  say "=== part: $name"
  if (cd "$out" && timeout "$limit" mpirun -n 2 "$@" 2>&1 | tee -a "$log"); then
    say "=== PASS: $name"
  else
    say "=== FAIL: $name"
    failed=1
  fi
}
cd "$out" || exit 2
part "selftest, staged through host" 150 env MPI4JAX_USE_CUDA_MPI=0 \
  python -m jaxsync selftest --mbytes 16 --iters 5
part "checks and times (staged)" 240 env MPI4JAX_USE_CUDA_MPI=0 \
  python "$root/scripts/gpu_check.py" --out "$out/gpu_check.md" ${GPU_CHECK_ARGS:-}
if [ "${GPU_CHECK_CUDA_MPI:-0}" = 1 ]; then
  part "checks and times (CUDA-aware MPI)" 120 env MPI4JAX_USE_CUDA_MPI=1 \
    python "$root/scripts/gpu_check.py" --out "$out/gpu_check_cuda_mpi.md" ${GPU_CHECK_ARGS:-}
fi
say "=== gpu_check: done in $((SECONDS - started)) s; failed=$failed; table: $out/gpu_check.md"
exit "$failed"

#!/usr/bin/env bash
# Create (or reuse) a virtual environment and install jaxsync with its MPI, test,
# benchmark, demo and docs extras. Needs only python3 (>= 3.10). A second run skips the
# work when nothing changed; a run that stopped half-way is redone.
#
# Every step's output goes to $VENV/setup.log. A failed step stops set-up at once
# with a non-zero exit, the step's name and the last lines of its output.
#
# Environment (all optional):
#   JAXSYNC_VENV    the virtual environment (default: .venv in the checkout)
#   JAXSYNC_CUDA    12 or 13: GPU build - jax[cudaNN] and mpi4jax's CUDA bridge,
#                   compiled against the toolkit folder that holds
#                   include/cuda_runtime.h ($CUDA_HOME, $CUDA_PATH, $CUDA_ROOT,
#                   /usr/local/cuda, ...; see jaxsync/_cli/_toolkit.py). Unset: CPU only,
#                   whatever CUDA toolkits the machine has.
#   JAXSYNC_SETUP_EXTRA_PACKAGES
#                   more pip requirements (space separated), installed first; also
#                   the hook the tests use to make a step fail.
#   JAXSYNC_JAX     the jax requirement (default: jax[cpu]>=0.10,<0.13, or
#                   jax[cudaNN]>=0.10,<0.13 with JAXSYNC_CUDA)
#   PYTHON          the interpreter that creates the environment (default: python3)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${JAXSYNC_VENV:-$root/.venv}"
py="${PYTHON:-python3}"
cuda="${JAXSYNC_CUDA:-}"
case "$cuda" in
  ""|0) cuda="" ;;
  12|13) ;;
  *) echo "[setup] JAXSYNC_CUDA must be 12, 13 or unset (CPU only), got '$cuda'." >&2; exit 2 ;;
esac
extra="${JAXSYNC_SETUP_EXTRA_PACKAGES:-}"

stamp="$venv/.jaxsync-setup"
inputs=(pyproject.toml setup.py scripts/setup.sh scripts/_setup_steps.sh scripts/verify_install.py jaxsync/_cli/_toolkit.py
        jaxsync/_comm/_native/*.cc jaxsync/_comm/_native/*.h)
want="$(for f in "${inputs[@]}"; do if [ -f "$f" ]; then cat "$f"; fi; done | sha256sum | cut -c1-16)"
want="$want cuda=$cuda extra=$extra jax=${JAXSYNC_JAX:-}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi

tag=setup
# shellcheck source=scripts/_setup_steps.sh
source "$root/scripts/_setup_steps.sh"

if [ ! -x "$venv/bin/python" ]; then
  step "create the virtual environment $venv" "$py" -m venv "$venv"
fi
export PATH="$venv/bin:$PATH"
step "upgrade pip and the build tools" pip install --upgrade pip setuptools wheel nanobind
if [ -n "$extra" ]; then
  # shellcheck disable=SC2086
  step "install JAXSYNC_SETUP_EXTRA_PACKAGES ($extra)" pip install $extra
fi

jax_req="jax[cpu]>=0.10,<0.13"
[ -n "$cuda" ] && jax_req="jax[cuda$cuda]>=0.10,<0.13"
# JAXSYNC_JAX: one requirement in its place (e.g. 'jax[cpu]==0.12.*'); scripts/test_jax12.sh
# uses it for the Python 3.12 + jax 0.12 environment.
jax_req="${JAXSYNC_JAX:-$jax_req}"
step "install $jax_req, MPI (mpich wheel) and mpi4py" \
  pip install "$jax_req" "mpich>=4" "mpi4py>=4.0"

# mpi4jax is built from source against the mpich wheel's MPI: mpicc from the
# environment, mpi4py + nanobind + setuptools + wheel without build isolation, and
# no pip cache (a cached wheel may have been built for another machine).
#  - CPU (default): CUDA_PATH and CUDA_ROOT point at an empty folder, so mpi4jax
#    builds its CPU bridge only, even when nvcc is on PATH.
#  - JAXSYNC_CUDA: CUDA_PATH is the toolkit folder that holds the headers.
build_mpi4jax() {
  local cuda_root="$venv/.no-cuda"
  if [ -n "$cuda" ]; then
    cuda_root="$("$venv/bin/python" "$root/jaxsync/_cli/_toolkit.py" cuda-root)" || return 1
    echo "CUDA toolkit: $cuda_root"
  else
    mkdir -p "$cuda_root"
  fi
  CUDA_PATH="$cuda_root" CUDA_ROOT="$cuda_root" MPI4JAX_BUILD_MPICC="$venv/bin/mpicc" \
    pip install --no-build-isolation --no-cache-dir --no-binary mpi4jax --force-reinstall \
    --no-deps "mpi4jax>=0.9,<0.10"
}
bridges() {  # which mpi4jax bridges are built: "cpu", "cpu cuda"
  "$venv/bin/python" - <<'EOF' 2>/dev/null || true
import importlib.util, pathlib
spec = importlib.util.find_spec("mpi4jax")
d = pathlib.Path(spec.origin).parent / "_src" / "xla_bridge"
print(" ".join(k for k in ("cpu", "cuda") if list(d.glob(f"mpi_xla_bridge_{k}*.so"))))
EOF
}
have="$(bridges)"
if [[ " $have " != *" cpu "* ]] || { [ -n "$cuda" ] && [[ " $have " != *" cuda "* ]]; }; then
  if [ -n "$cuda" ]; then what="CPU and CUDA bridges"; else what="CPU bridge only"; fi
  step "build mpi4jax from source ($what, about 30 s)" build_mpi4jax
fi

# jaxsync's own native MPI target (jaxsync/_comm/_native) is compiled here, with the
# environment's MPI compiler wrapper (the MPI that mpi4py loads); a missing wrapper
# or a failed compile stops set-up.
MPICC="$venv/bin/mpicc" JAXSYNC_REQUIRE_NATIVE=1 \
  step "install jaxsync (editable, with its native MPI target) and the mpi, test, bench, demo and docs extras" \
  pip install --no-build-isolation -e ".[mpi,test,bench,demo,docs]"

# The stamp means "verified": every extra imports, versions match their pins, and
# `import jaxsync` resolves to this checkout through the install (run from outside).
verify() { (cd "$(mktemp -d)" && JAXSYNC_CUDA="$cuda" "$venv/bin/python" \
  "$root/scripts/verify_install.py" "$root"); }
step "verify the install from outside the checkout" verify
grep "^\[setup\] ok" "$log" | tail -n 1
echo "$want" > "$stamp"
echo "[setup] done in $((SECONDS - started)) s (log: $log)"

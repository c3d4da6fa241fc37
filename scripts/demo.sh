#!/usr/bin/env bash
# Run the demo: data-parallel training under mpirun, 2 processes x 2 fake CPU
# devices (sets everything up first). Extra args go to `python -m jaxsync demo`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${JAXSYNC_VENV:-$root/.venv}"
bash "$root/scripts/setup.sh"
export PATH="$venv/bin:$PATH"
exec "$venv/bin/python" -m jaxsync demo "$@"

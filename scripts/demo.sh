#!/usr/bin/env bash
# Run the demo: data-parallel training under mpirun, 2 processes x 2 fake CPU
# devices (sets everything up first). Extra args go to `python -m jaxsync demo`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
export PATH="$root/.venv/bin:$PATH"
exec "$root/.venv/bin/python" -m jaxsync demo "$@"

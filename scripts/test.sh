#!/usr/bin/env bash
# Run the whole test suite (sets everything up first). Extra args go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${JAXSYNC_VENV:-$root/.venv}"
bash "$root/scripts/setup.sh"
cd "$root"
export PATH="$venv/bin:$PATH"
exec "$venv/bin/python" -m pytest -q "$@"

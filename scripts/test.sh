#!/usr/bin/env bash
# Run the whole test suite (sets everything up first). Extra args go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
export PATH="$root/.venv/bin:$PATH"
exec "$root/.venv/bin/python" -m pytest -q "$@"

#!/usr/bin/env bash
# Run the whole test suite (sets everything up first): lint, format and type
# checks, then pytest. Extra args go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${JAXSYNC_VENV:-$root/.venv}"
bash "$root/scripts/setup.sh"
cd "$root"
export PATH="$venv/bin:$PATH"
echo "[test] ruff check, ruff format --check, mypy (config in pyproject.toml)"
"$venv/bin/ruff" check --no-cache .
"$venv/bin/ruff" format --no-cache --check .
"$venv/bin/mypy" --cache-dir "$venv/.mypy_cache"
exec "$venv/bin/python" -m pytest -q "$@"

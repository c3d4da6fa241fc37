#!/usr/bin/env bash
# Run the whole test suite (sets everything up first): lint, format and type
# checks, the docs build, then pytest. Extra args go to pytest.
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
# The documentation site (mkdocs.yml), warnings as errors, into a folder of its own
# (site/ is git-ignored; mkdocs serve for a live preview). Not --quiet: mkdocs counts
# only the warnings it prints, so --strict --quiet passes a broken link.
echo "[test] mkdocs build --strict"
site="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 "$venv/bin/mkdocs" build --strict --site-dir "$site" \
  || { rm -rf "$site"; exit 1; }
rm -rf "$site"
exec "$venv/bin/python" -m pytest -q "$@"

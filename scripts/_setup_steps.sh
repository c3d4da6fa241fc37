# Shared by scripts/setup.sh and scripts/setup_ft.sh (sourced): the log and `step`.
# Needs $venv and $tag (the prefix of every line, e.g. "setup") set by the caller.

mkdir -p "$venv"
rm -f "$stamp"                      # written again only after the final check
log="$venv/setup.log"
: > "$log"
started=$SECONDS

# step NAME COMMAND...: run COMMAND with its output in the log; on failure print the
# step's name, exit status and last lines, and stop set-up.
step() {
  local name="$1"; shift
  local out rc t0=$SECONDS
  out="$(mktemp)"
  echo "[$tag] $name"
  printf '\n===== %s: %s\n' "$name" "$*" >> "$log"
  if "$@" > "$out" 2>&1; then rc=0; else rc=$?; fi
  cat "$out" >> "$log"
  if [ "$rc" -ne 0 ]; then
    {
      echo "[$tag] FAILED: $name (exit status $rc). Last lines of its output:"
      tail -n 25 "$out" | sed 's/^/    /'
      echo "[$tag] full log: $log"
      echo "[$tag] nothing was marked done; fix the cause and run this again."
    } >&2
    rm -f "$out"
    exit "$rc"
  fi
  rm -f "$out"
  echo "        done in $((SECONDS - t0)) s" >> "$log"
}

pip() { "$venv/bin/python" -m pip --disable-pip-version-check "$@"; }

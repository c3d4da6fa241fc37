# `step`, shared by every set-up script (sourced): needs $tag (the prefix of every
# line, e.g. "setup") and $log (the log file) set by the caller; $step_fix, if set, is
# the last line of a failure's report.

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
      echo "[$tag] ${step_fix:-fix the cause and run this again.}"
    } >&2
    rm -f "$out"
    exit "$rc"
  fi
  rm -f "$out"
  echo "        done in $((SECONDS - t0)) s" >> "$log"
}

#!/usr/bin/env bash
# The cost model's accuracy check (issue 13): for each configuration, calibrate
# (`python -m jaxsync tune`, written to OUT/profile-PxD.json) and then time every
# strategy and auto_mean on the bench's trees against the model's predictions
# (`python -m jaxsync bench --suite model --profile ...`), then merge them all
# (`--collect`) into OUT/model.md (table, noise floor), OUT/model.json (summary)
# and OUT/model.png (predicted against measured).
#
# Usage: scripts/model_accuracy.sh OUT_DIR
#   CONFIGS="1x8 2x1 ..."  configurations, PROCESSESxDEVICES (default below: six of the
#                          seven the issue names; 3x4 is left out to stay near 15 min on
#                          an idle 2-core machine - add it with CONFIGS="... 3x4")
#   QUICK=1                a smoke test: quick calibration, the small500 tree, 2 rounds
#   REPEAT=1               then measure every configuration again on the same profiles
#                          (OUT/repeat/): the report adds how well the first measurement
#                          predicts the second, the machine's own reproducibility (about
#                          two thirds as long again)
#   ALLOCATOR=default      calibrate and measure with glibc's default allocator (default:
#                          tuned, jaxsync.tune_host_allocator() in tune and bench alike, so
#                          the costs of large buffers do not depend on allocation history)
# Run it on an idle machine, with the project's venv first on PATH (python, mpirun).
# Logs: OUT/log-PxD.txt. A configuration that fails is reported and skipped.
set -uo pipefail
out="${1:?usage: scripts/model_accuracy.sh OUT_DIR}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/_model_accuracy.sh
source "$root/scripts/_model_accuracy.sh"
mpirun="${JAXSYNC_MPIRUN:-$(dirname "$py")/mpirun}"
configs="${CONFIGS:-1x8 2x1 2x2 2x4 3x1 3x2}"
measure_args --trees resnet18 small500 mixed --repeats 5 --min-sample-ms 10
if [[ "${ALLOCATOR:-tuned}" == tuned ]]; then
  tune_args+=(--tune-host-allocator)
  bench_args+=(--tune-host-allocator)
fi
# launch CFG ARGS...: python -m jaxsync ARGS in configuration CFG (PxD), under
# mpirun for more than one process, with --devices D
launch() {
  local p="${1%x*}" d="${1#*x}"
  shift
  local cmd=("$py")
  [[ "$p" -gt 1 ]] && cmd=("$mpirun" -n "$p" "$py")
  "${cmd[@]}" -m jaxsync "$@" --devices "$d"
}
for cfg in $configs; do
  echo "== $cfg (${cfg%x*} process(es) x ${cfg#*x} device(s)); $((SECONDS - start)) s so far" >&2
  calibrate "$cfg" || continue
  grep -A12 '^profile (measured' "$out/log-$cfg.txt" | head -12 >&2 || true
done
if [[ "${REPEAT:-0}" == 1 ]]; then
  mkdir -p "$out/repeat"
  for cfg in $configs; do
    [[ " ${failed[*]:-} " == *" $cfg "* ]] && continue
    remeasure "$cfg"
  done
fi
collect 6

#!/usr/bin/env bash
# The cost model's accuracy check on the emulated cluster (issue 25): for each
# configuration HOSTSxPROCSxDEVICES@LINK, inside `python -m jaxsync cluster`,
# calibrate (`python -m jaxsync tune`: the device, shared-memory and network links,
# written to OUT/profile-CFG.json) and then time every strategy and auto_mean on
# the bench's trees against the model's predictions (`python -m jaxsync bench
# --suite model --profile ...`), then merge them all (`--collect`) into OUT/model.md
# (table, noise floor, reproducibility), OUT/model.json and OUT/model.png.
#
# Usage: scripts/model_accuracy_cluster.sh OUT_DIR
#   CONFIGS="2x1x1@1gbit ..."  configurations (default: 2 hosts x 1 and 2 processes x 1
#                          and 2 devices, at 1gbit and 10gbit: eight)
#   QUICK=1                a smoke test: quick calibration, the small500 tree, 2 rounds
#   REPEAT=1               measure each configuration again right after, on the same
#                          profile (OUT/repeat/): the report adds how well the first
#                          measurement predicts the second (the noise floor the model is
#                          held to)
#   TREES="..."            the bench's trees (default: resnet18 small500 transformer mixed)
#   ROUNDS=5               rounds per measurement
#   HOST_TIER=1            turn the host tier on (JAXSYNC_HOST_TIER=1) in tune and bench
#   TIMEOUT=900            time limit of each cluster run, seconds
# Needs the emulated cluster (python -m jaxsync cluster; docs/cluster.md) and the
# project's venv first on PATH. Logs: OUT/log-CFG.txt. A configuration that fails is
# reported and skipped. `ip netns list` is empty afterwards (the namespaces are the
# cluster's own and go with it).
set -uo pipefail
out="${1:?usage: scripts/model_accuracy_cluster.sh OUT_DIR}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/_model_accuracy.sh
source "$root/scripts/_model_accuracy.sh"
export JAXSYNC_HOST_TIER="${HOST_TIER:-0}"
configs="${CONFIGS:-2x1x1@1gbit 2x2x1@1gbit 2x1x1@10gbit 2x2x1@10gbit 2x1x2@1gbit 2x2x2@1gbit 2x1x2@10gbit 2x2x2@10gbit}"
timeout="${TIMEOUT:-900}"
# shellcheck disable=SC2086
measure_args --trees ${TREES:-resnet18 small500 transformer mixed} --repeats "${ROUNDS:-5}" \
  --min-sample-ms 10
tune_args+=(--tune-host-allocator)
bench_args+=(--tune-host-allocator)
# launch CFG ARGS...: python -m jaxsync ARGS inside the emulated cluster of CFG
launch() {
  local cfg="$1" hosts rest procs devices link
  shift
  hosts="${cfg%%x*}"; rest="${cfg#*x}"; procs="${rest%%x*}"; rest="${rest#*x}"
  devices="${rest%@*}"; link="${cfg#*@}"
  "$py" -m jaxsync cluster --hosts "$hosts" --procs-per-host "$procs" --link "$link" \
    --devices "$devices" --timeout "$timeout" -- "$py" -m jaxsync "$@" --devices "$devices"
}
[[ "${REPEAT:-0}" == 1 ]] && mkdir -p "$out/repeat"
for cfg in $configs; do
  echo "== $cfg; $((SECONDS - start)) s so far (load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
  calibrate "$cfg" || continue
  grep -A6 'profile (measured' "$out/log-$cfg.txt" | head -8 >&2 || true
  if [[ "${REPEAT:-0}" == 1 ]]; then  # right after, on the same profile
    remeasure "$cfg"
  fi
done
collect 8

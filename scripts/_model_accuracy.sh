# The steps of the cost model's accuracy checks (sourced by scripts/model_accuracy.sh
# and scripts/model_accuracy_cluster.sh): calibrate a configuration, measure it on its
# profile, measure it again, merge the results. Needs $out (made here) and $root (the
# checkout: the working folder, first on PYTHONPATH, from here on) set before it is
# sourced; sets $py (the python on PATH). The functions need $configs, the arrays
# tune_args and bench_args (measure_args sets them) and the caller's
# `launch CFG ARGS...` (python -m jaxsync ARGS in configuration CFG, with CFG's
# --devices). Keeps the configurations that failed in `failed`, the start in `start`.

mkdir -p "$out"
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
py="$(command -v python)"
failed=()
start=$SECONDS

# measure_args BENCH_ARGS...: the arrays tune_args and bench_args: QUICK=1, a smoke
# test (quick calibration, the small500 tree, 2 rounds), else a full calibration and
# the model suite with BENCH_ARGS
measure_args() {
  if [[ "${QUICK:-0}" == 1 ]]; then
    tune_args=(--quick)
    bench_args=(--trees small500 --repeats 2 --min-sample-ms 5)
  else
    tune_args=()
    bench_args=("$@")
  fi
}

# measure CFG DIR: the model suite on OUT/profile-CFG.json, results in DIR
measure() {
  launch "$1" bench --suite model "${bench_args[@]}" --profile "$out/profile-$1.json" --out "$2"
}

# calibrate CFG: the profile of CFG (tune, into OUT/profile-CFG.json), then the model
# suite measured on it into OUT, both logged to OUT/log-CFG.txt; a failure is reported,
# added to `failed` and returns 1
calibrate() {
  if launch "$1" tune "${tune_args[@]}" --out "$out/profile-$1.json" >"$out/log-$1.txt" 2>&1 &&
     measure "$1" "$out" >>"$out/log-$1.txt" 2>&1; then
    return 0
  fi
  echo "   $1 FAILED (see $out/log-$1.txt)" >&2
  failed+=("$1")
  return 1
}

# remeasure CFG: the model suite again on CFG's profile, into OUT/repeat (logged to
# OUT/repeat/log-CFG.txt); a failure is reported and added to `failed` as repeat-CFG
remeasure() {
  echo "== repeat $1; $((SECONDS - start)) s so far" >&2
  measure "$1" "$out/repeat" >"$out/repeat/log-$1.txt" 2>&1 ||
    { echo "   repeat $1 FAILED (see $out/repeat/log-$1.txt)" >&2; failed+=("repeat-$1"); }
}

# collect LINES: merge every result (--collect) into OUT/model.md, OUT/model.json and
# OUT/model.png (its last LINES lines shown), say how long it all took and what failed;
# returns 1 if anything failed
collect() {
  "$py" -m jaxsync bench --suite model --collect --out "$out" | tail -n "$1"
  echo "took $((SECONDS - start)) s; configurations: $configs; failed: ${failed[*]:-none}" >&2
  [[ ${#failed[@]} -eq 0 ]]
}

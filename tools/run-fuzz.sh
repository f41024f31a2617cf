#!/usr/bin/env bash
# Runs every fuzz target of a WKV_FUZZ build for FUZZ_SECONDS (60) each,
# FUZZ_JOBS (the CPUs there are) targets at a time: each target is one
# libFuzzer process, its inputs run one after another.
#
#   tools/run-fuzz.sh <build-dir> [extra libFuzzer flags]
#
# Each tests/fuzz/fuzz_<name>.cpp starts from its seed corpus
# tests/fuzz/corpus/<name> (read only) and from <build-dir>/corpus/<name>,
# where the inputs it finds are kept for the next run. A crash, leak or
# failed check is written to <build-dir>/crashes/<name>/ and fails the run;
# copy such an input into the seed corpus once it is fixed, so that every
# test run replays it. Prints each target's executions and final status.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

build="${1:?usage: tools/run-fuzz.sh <build-dir> [libFuzzer flags]}"
shift
seconds="${FUZZ_SECONDS:-60}"
parallel="${FUZZ_JOBS:-}"
[ -n "$parallel" ] && [ "$parallel" -gt 0 ] 2>/dev/null || parallel="$(nproc)"
names=()
for src in tests/fuzz/fuzz_*.cpp; do
  names+=("$(basename "$src" .cpp)")
done

log_of() { echo "$build/fuzz-${1#fuzz_}.log"; }

# fuzz <name> [flags]: one target's run, its exit status in its log's .rc.
fuzz() {
  local name="$1" corpus="${1#fuzz_}"
  shift
  local log rc=0
  log="$(log_of "$name")"
  mkdir -p "$build/corpus/$corpus" "$build/crashes/$corpus"
  "$build/bin/$name" -max_total_time="$seconds" -print_final_stats=1 -rss_limit_mb=4096 \
    -timeout=60 -artifact_prefix="$build/crashes/$corpus/" "$@" \
    "$build/corpus/$corpus" "tests/fuzz/corpus/$corpus" > "$log" 2>&1 || rc=$?
  echo "$rc" > "$log.rc"
}

echo "${#names[@]} targets, ${seconds} s each, $parallel at a time"
# The targets stop with the script.
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
running=0
for name in "${names[@]}"; do
  # No status from an earlier run may stand in for this one's.
  rm -f "$(log_of "$name").rc"
  if [ "$running" -ge "$parallel" ]; then
    wait -n || true
    running=$((running - 1))
  fi
  fuzz "$name" "$@" &
  running=$((running + 1))
done
wait

status=0
for name in "${names[@]}"; do
  corpus="${name#fuzz_}"
  log="$(log_of "$name")"
  echo "$name: ${seconds} s (log: $log)"
  if [ "$(cat "$log.rc" 2>/dev/null)" = 0 ]; then
    echo "  ok: $(grep -E 'stat::number_of_executed_units' "$log" | awk '{print $2}') executions," \
         "$(ls "$build/corpus/$corpus" | wc -l) inputs in its corpus," \
         "peak RSS $(grep -E 'stat::peak_rss_mb' "$log" | awk '{print $2}') MB"
  else
    status=1
    echo "  FAILED: the input is in $build/crashes/$corpus/; the report:"
    grep -E -A40 '^==[0-9]+==ERROR|fuzz_[a-z_]+: |runtime error|deadly signal' "$log" | head -60 ||
      tail -40 "$log" 2>/dev/null || echo "  (no log: the target did not start)"
  fi
done
exit $status

#!/usr/bin/env bash
# Runs the serving benchmark under several settings of the environment, in
# turn, for some rounds (A B A B ...), so that settings are compared on one
# machine within one call; prints each run's rows last.
#
#   tools/gpu-ab.sh 'VAR=a' 'VAR=b' [...] -- [gpu_serving_bench arguments]
#
# Environment: ROUNDS (2), BENCH (build-gpu/bin/gpu_serving_bench), OUT (the
# logs: $OUT/ab-<round>-<n>.log; ./gpu-ab-logs), BENCH_TIMEOUT (seconds a
# run, 300). A setting may hold several assignments ('A=1 B=2') or none ('');
# BENCH=path in a setting runs that build's bench instead, so that two
# versions of the code are compared the same way (docs/gpu-machine.md).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
settings=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do settings+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
if [ ${#settings[@]} -eq 0 ]; then
  echo "usage: tools/gpu-ab.sh 'VAR=a' 'VAR=b' [...] -- [bench arguments]" >&2
  exit 2
fi
BENCH=${BENCH:-build-gpu/bin/gpu_serving_bench}
OUT=${OUT:-$PWD/gpu-ab-logs}
mkdir -p "$OUT"
summary=$OUT/ab-summary.txt
: > "$summary"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for i in "${!settings[@]}"; do
    log=$OUT/ab-$round-$i.log
    bench=$BENCH
    for a in ${settings[$i]}; do [[ "$a" == BENCH=* ]] && bench=${a#BENCH=}; done
    # shellcheck disable=SC2086 # a setting is a list of assignments
    env ${settings[$i]} timeout "${BENCH_TIMEOUT:-300}" "$bench" "$@" > "$log" 2>&1
    rc=$?
    {
      echo "== round $round, setting [${settings[$i]}], $bench, rc=$rc"
      # The table's rows, and the lines under them that say what a step did.
      grep -E '^ +[0-9]+ +[0-9.]+ |decodes replayed|buffer manager:|host us \(medians\)|device us \(medians' "$log"
    } >> "$summary"
  done
done
cat "$summary"

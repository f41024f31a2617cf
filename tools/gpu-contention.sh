#!/usr/bin/env bash
# Runs COPIES copies of one GPU test program at once, ROUNDS times: a test
# that passes alone but not while other processes share the GPU (its
# kernels time-sliced, its streams delayed against the host) shows a race
# between the host and the device, or between the engine's streams. Prints
# the passes and failures of every round, then each failure's gtest lines;
# the logs go to $OUT/contention/ ($OUT defaults to ./gpu-check-logs).
#
#   tools/gpu-contention.sh PROGRAM [GTEST_FILTER] [COPIES] [ROUNDS]
#   e.g. tools/gpu-contention.sh build-gpu/bin/gpu_batch '*AcrossGrowths' 6 3
#
# The environment reaches every copy (WKV_DEVICE_CACHE_BYTES=1: no device
# cache, where 0 is the default of 5% of the device;
# CUDA_LAUNCH_BLOCKING=1, ... to tell which part of the engine is at fault).
set -uo pipefail
prog=${1:?usage: tools/gpu-contention.sh PROGRAM [GTEST_FILTER] [COPIES] [ROUNDS]}
filter=${2:-*}
copies=${3:-6}
rounds=${4:-3}
OUT=${OUT:-$PWD/gpu-check-logs}
dir="$OUT/contention"
mkdir -p "$dir"
tag=$(date +%s%N)
failed=0
for r in $(seq 1 "$rounds"); do
  pids=()
  for c in $(seq 1 "$copies"); do
    "$prog" --gtest_filter="$filter" > "$dir/$tag-r$r-c$c.log" 2>&1 &
    pids+=($!)
  done
  pass=0 fail=0
  for i in "${!pids[@]}"; do
    if wait "${pids[$i]}"; then pass=$((pass + 1)); else fail=$((fail + 1)); fi
  done
  failed=$((failed + fail))
  printf 'round %d: %d passed, %d failed\n' "$r" "$pass" "$fail"
done
for f in "$dir/$tag"-*.log; do
  if grep -q "^\[  FAILED  \]\|: Failure$" "$f"; then
    echo "--- $(basename "$f")"
    grep -E "Failure|first off|Expected|Which is|FAILED" "$f" | head -12
  fi
done
[ "$failed" = 0 ]

#!/bin/bash
# One device call for docs/wip's patches (docs/wip/README.md): run on the GPU
# machine from the repository root, with the two patches applied to the
# working tree and main's code in build-base-src/ (both prepared before the
# call, on this side):
#
#   git apply docs/wip/2-select-lays-out-offsets.patch docs/wip/3-logits-whole-sectors.patch
#   rm -rf build-base-src && mkdir build-base-src && git archive HEAD | tar -x -C build-base-src
#   # device call (name kind nvidia-h200: a failed start then costs 90 s,
#   # not 180), carrying .debs and build-base-src:
#   LIMIT=590 bash docs/wip/gpu-call.sh
#
# PHASE=time (the default): builds the three targets it runs (the bench and
# the lookup and batch tests) of the patched tree and main's bench; two A/B
# rounds at 1M, 8-bit pages, a 20% device cache (main, the patches, the
# patches with the estimate at the caller's priority:
# WKV_DECODE_SIDE_LEVELS=9, docs/gpu-serving.md); ncu of
# the select, the logits and main's offsets kernel in both; then the lookup
# and batch tests.
# PHASE=suite (a second call, on the machine the first left warm): builds
# every target, runs the GPU suite (ctest -R gpu_), then memcheck and
# racecheck of the lookup tests a test at a time, with the time left.
# LIMIT: the call's seconds; steps that would pass it are skipped. Logs go
# to $OUT/logs.tar.gz after each step.
set -u
OUT=${OUT:-$PWD/gpu-call-logs}
mkdir -p "$OUT"
T0=$SECONDS
LIMIT=${LIMIT:-590}
PHASE=${PHASE:-time}
left() { echo $((LIMIT - 10 - (SECONDS - T0))); }
pack() { tar -czf $OUT/logs.tar.gz -C /tmp $(cd /tmp && ls -d build-*.txt lookup-tests*.txt batch-tests.txt ab ctest-gpu.txt san ncu-*.csv 2>/dev/null); }
t() { echo "$1 rc=$2 $((SECONDS-T0)) s $(grep -E '^\[  (PASSED|FAILED)|tests ran' $3 | tr '\n' ' ')"; grep -E "Failure|FAILED  \]" $3 | head -5; }
export LD_LIBRARY_PATH=/tmp/wkv-debs/usr/lib/x86_64-linux-gnu
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader

if [ "$PHASE" = time ]; then
  (JOBS=11 BUILD_TARGETS="gpu_serving_bench gpu_lookup_attention gpu_batch" OUT=/tmp/cur tools/gpu-check.sh build > /tmp/build-cur.txt 2>&1; echo "build cur rc=$?") &
  (cd build-base-src && ln -sfn ../.debs .debs && JOBS=5 BUILD_TARGETS=gpu_serving_bench OUT=/tmp/base tools/gpu-check.sh build > /tmp/build-base.txt 2>&1; echo "build base rc=$?") &
  wait; echo "builds $((SECONDS-T0)) s"; grep -hE "error" -A3 /tmp/build-*.txt | head -20
  export WKV_PAGE_FORMAT=1 WKV_SERVING_CACHE_FRACTION=0.2
  [ "$(left)" -gt 200 ] && ROUNDS=2 OUT=/tmp/ab BENCH_TIMEOUT=80 tools/gpu-ab.sh "BENCH=build-base-src/build-gpu/bin/gpu_serving_bench" '' 'WKV_DECODE_SIDE_LEVELS=9' -- 1048576 1 2>&1 | grep -E "^==|^ +[0-9]+ +[0-9.]+ |device us \(med|host us"
  echo "ab $((SECONDS-T0)) s"
  pack
  # ncu: each build's select and logits (and the offsets kernel main still has).
  for which in cur base; do
    [ "$(left)" -gt 110 ] || break
    bin=build-gpu/bin/gpu_serving_bench; [ $which = base ] && bin=build-base-src/build-gpu/bin/gpu_serving_bench
    timeout 60 ncu --clock-control none --metrics gpu__time_duration.sum \
      --csv --kernel-name-base function --kernel-name regex:'select_kernel|logits_kernel|offsets_kernel' \
      --launch-skip 400 --launch-count 200 $bin 1048576 1 80 4 > /tmp/ncu-$which.csv 2>/dev/null
    echo "ncu $which rc=$? $((SECONDS-T0)) s"; python3 tools/ncu_table.py time /tmp/ncu-$which.csv | grep -E "select|logits|offsets"
  done
  unset WKV_PAGE_FORMAT WKV_SERVING_CACHE_FRACTION
  pack
  [ "$(left)" -gt 40 ] && { timeout $(left) build-gpu/bin/gpu_lookup_attention --gtest_brief=1 > /tmp/lookup-tests.txt 2>&1; t gpu_lookup_attention $? /tmp/lookup-tests.txt; }
  [ "$(left)" -gt 20 ] && { timeout $(left) build-gpu/bin/gpu_batch --gtest_brief=1 > /tmp/batch-tests.txt 2>&1; t gpu_batch $? /tmp/batch-tests.txt; }
else
  JOBS=16 OUT=/tmp/cur tools/gpu-check.sh build > /tmp/build-all.txt 2>&1; echo "build all rc=$? $((SECONDS-T0)) s"
  grep -hE "error" -A3 /tmp/build-all.txt | head -20
  if [ "$(left)" -gt 60 ]; then
    (cd build-gpu && timeout $(( $(left) - 45 )) ctest -R gpu_ --output-on-failure -j3 --timeout 200) > /tmp/ctest-gpu.txt 2>&1
    echo "ctest gpu_ rc=$? $((SECONDS-T0)) s"; grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)|Not Run" /tmp/ctest-gpu.txt | head -20
    grep -cE "Test +#[0-9]+: .*Passed" /tmp/ctest-gpu.txt
  fi
  pack
  # memcheck, then racecheck, of the lookup tests a test at a time
  # (gpu-check.sh's sanitize step; its logs in /tmp/san).
  [ "$(left)" -gt 25 ] && SANITIZER_TOOLS="memcheck racecheck" SANITIZER_TESTS=gpu_lookup_attention SANITIZER_PER_TEST=1 \
    SANITIZER_TIMEOUT=120 OUT=/tmp/san timeout $(left) tools/gpu-check.sh sanitize
fi
pack
echo "done $((SECONDS-T0)) s"

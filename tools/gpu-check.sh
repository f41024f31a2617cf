#!/usr/bin/env bash
# Builds wavekv on a GPU machine, runs every test (GPU suites included), the
# GPU suites again under compute-sanitizer, and the GPU benchmarks, then
# prints a short table. The logs are packed into $OUT/gpu-check-logs.tar.gz
# beside $OUT/summary.txt ($OUT defaults to ./gpu-check-logs).
#
#   tools/gpu-check.sh [STEP...]   steps: build test sanitize bench (default),
#                                  serving (decoding throughput against full
#                                  attention: bench/gpu_serving_bench.cu with
#                                  its PyTorch anchor, at 128K tokens over
#                                  SERVING_BATCHES, 1,2,4,7, and at 1M tokens,
#                                  batch 1, unless SERVING_1M=0, once per
#                                  device cache fraction of
#                                  SERVING_1M_FRACTIONS, "0.05"; first
#                                  gpu_gather_bench's gather at 16 and 256
#                                  MiB, the machine's reads of host memory)
#                                  profile (ncu: device time of each kernel
#                                  of one k-means batch, summed by kernel)
#                                  and spill (1M tokens, batch 1, 32 layers:
#                                  128 GiB of bf16 KV under a host budget of
#                                  SPILL_HOST_BUDGET_GIB, 96, the rest in a
#                                  spill file in SPILL_DIR, /tmp/wkv-spill;
#                                  SPILL_LAYERS, SPILL_STEPS)
#                                  demo (`wavekv demo`, a CPU engine, on
#                                  DEMO_TOKENS, 1048576, x 4 layers of 8 KV
#                                  heads, d=128, f16: first with everything in
#                                  memory, then under DEMO_BUDGET, 4GiB, with
#                                  the rest in SPILL_DIR: --compare-in-memory)
#                                  capture (the runtime-captured step:
#                                  the gpu_capture tests, then the serving
#                                  bench's verbs against its captured graph)
#                                  decode-profile (ncu: device time of each
#                                  kernel of the serving bench's decoding
#                                  steps, median and mean us a launch, and
#                                  the lookup kernels' stall reasons (unless
#                                  PROFILE_DETAIL=0), for each case of
#                                  PROFILE_CASES, "131072:7 1048576:1",
#                                  tokens:batch, after its warm-up; the 1M
#                                  case at a 20% device cache)
#                                  source-profile (ncu: where the warps of
#                                  SOURCE_KERNEL, select_kernel, wait, by
#                                  instruction (warp samples), one launch
#                                  of the serving bench's decode at
#                                  SOURCE_CASE, 1048576:1 (tokens:batch; 1M
#                                  at a 20% device cache); the report and
#                                  its source page go to $OUT)
#                                  policies (the device cache's replacement
#                                  policies against each other: the serving
#                                  bench at 128K, batch POLICY_BATCHES, 7,
#                                  once per policy of POLICIES, lru clock
#                                  slru, for POLICY_ROUNDS rounds, 2)
#
# Environment: BUILD_TARGETS (the targets the build step builds: all of
# them unless set, e.g. "wavekv gpu_batch"), SANITIZER_TOOLS (memcheck racecheck), SANITIZER_TESTS (every
# tests/gpu_*.cpp program), SANITIZER_PER_TEST (1: each test of a program
# on its own, under its own timeout), SANITIZER_ARGS (added to each test program's
# command line, e.g. --gtest_filter=...), SANITIZER_TIMEOUT and BENCH_TIMEOUT
# (seconds a program, 240).
#
# The steps after build reuse build-gpu/, so that they can be split across
# several runs on one machine (each run must end within its time limit).
#
# The machine needs nvcc and CMake; libraries it lacks (liburing, mimalloc,
# GoogleTest, oneTBB, xxHash) may come as Debian packages in .debs/
# (docs/gpu-machine.md), unpacked under a prefix here.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$PWD/gpu-check-logs}
mkdir -p "$OUT"
JOBS=${JOBS:-$(nproc)}
STEPS=" ${*:-build test sanitize bench} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
LOG=$(mktemp -d)
trap 'cp "$LOG/summary.txt" "$OUT/" 2>/dev/null; tar -C "$LOG" -czf "$OUT/gpu-check-logs.tar.gz" .' EXIT

if [ -d .debs ] && ls .debs/*.deb >/dev/null 2>&1; then
  PREFIX=/tmp/wkv-debs
  mkdir -p $PREFIX
  for f in .debs/*.deb; do dpkg -x "$f" $PREFIX; done
  export CMAKE_PREFIX_PATH=$PREFIX/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
  export PKG_CONFIG_PATH=$PREFIX/usr/lib/x86_64-linux-gnu/pkgconfig
  export LD_LIBRARY_PATH=$PREFIX/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export CPATH=$PREFIX/usr/include
  export LIBRARY_PATH=$PREFIX/usr/lib/x86_64-linux-gnu
fi
export WKV_SKIP_DEPS=1
# The real-attention set, where the device call carried it in build-shared/
# (docs/gpu-machine.md): the tests that need it run instead of skipping
# (ctest passes the CMake cache's WKV_SHARED_DIR, so the build step sets it
# there too).
if [ -z "${WKV_SHARED_DIR:-}" ] && [ -d build-shared/data/real-attention ]; then
  export WKV_SHARED_DIR=$PWD/build-shared
fi

step() { printf '%-30s %s\n' "$1" "$2" | tee -a "$LOG/summary.txt"; }
: > "$LOG/summary.txt"
step gpu "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1)"

if want build || [ ! -d build-gpu ]; then
  start=$SECONDS
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DWKV_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    ${WKV_SHARED_DIR:+-DWKV_SHARED_DIR="$WKV_SHARED_DIR"} > "$LOG/configure.log" 2>&1 && cmake --build build-gpu -j"$JOBS" ${BUILD_TARGETS:+--target $BUILD_TARGETS} > "$LOG/build.log" 2>&1
  build_rc=$?
  step build "$([ $build_rc = 0 ] && echo "ok ($((SECONDS - start)) s)" || echo "FAILED (see build.log)")"
  if [ $build_rc != 0 ]; then grep -E "error" -A3 "$LOG/build.log" | head -60; exit 1; fi
fi

# The engines read their WKV_* configuration variables in every process,
# tests included: say which ones this run has, since a suite run with one
# set (WKV_PAGE_FORMAT=1, say) is a suite in that mode, and the tests that
# compare modes with each other fail under it (docs/gpu-machine.md).
wkv_env=$(env | grep -E '^WKV_' | grep -vE '^WKV_(SKIP_DEPS|SHARED_DIR)=' | sort | tr '\n' ' ')
if want test || want sanitize; then
  step "WKV_ variables set" "${wkv_env:-none}"
fi
if want test; then
  (cd build-gpu && ctest --output-on-failure -j8 --timeout 300) > "$LOG/ctest.log" 2>&1
  step "ctest (all)" "$(grep -E 'tests passed|tests failed' "$LOG/ctest.log" | tail -1)"
  grep -E "\(Failed\)|\(Timeout\)|Exception" "$LOG/ctest.log" | head -20 | tee -a "$LOG/summary.txt"
  step "  gpu tests skipped" "$(grep -cE '^[[:space:]]+[0-9]+ - gpu_.*\(Skipped\)' "$LOG/ctest.log")"
fi

if want sanitize && command -v compute-sanitizer >/dev/null; then
  san_fail=0
  # The GPU test programs (tests/gpu_*.cpp), not the benchmarks. API errors
  # are not reported: the tests provoke some on purpose (a device out of
  # memory) and check the statuses themselves.
  for tool in ${SANITIZER_TOOLS:-memcheck racecheck}; do
    for name in ${SANITIZER_TESTS:-$(cd tests && ls gpu_*.cpp | sed 's/\.cpp$//')}; do
      # A program at a time, or with SANITIZER_PER_TEST=1 a test at a time
      # (each under SANITIZER_TIMEOUT: racecheck is slow enough on the
      # capture tests that one of them would take a whole program's time).
      if [ "${SANITIZER_PER_TEST:-0}" = 1 ]; then
        units=$("build-gpu/bin/$name" --gtest_list_tests ${SANITIZER_ARGS:-} | awk '/^[^ ]/{s=$1} /^  /{print s $1}')
      else
        units=all
      fi
      for unit in $units; do
        filter=() tag=$name
        [ "$unit" = all ] || { filter=(--gtest_filter="$unit"); tag=$name.$unit; }
        WKV_TEST_UNDER_SANITIZER=$tool timeout "${SANITIZER_TIMEOUT:-240}" compute-sanitizer --tool "$tool" --report-api-errors no \
          --error-exitcode 9 "build-gpu/bin/$name" --gtest_brief=1 ${SANITIZER_ARGS:-} "${filter[@]}" > "$LOG/$tool-$tag.log" 2>&1
        rc=$?
        [ $rc = 0 ] || san_fail=1
        step "  $tool $tag" "rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOG/$tool-$tag.log" | tail -1)"
      done
    done
  done
  step compute-sanitizer "$([ $san_fail = 0 ] && echo clean || echo "ERRORS (see memcheck-*.log, racecheck-*.log)")"
fi

if want bench; then
  anchor=$(python3 bench/gpu_prefill_anchor.py 2>"$LOG/anchor.err" | awk '/prefill_ms/{print $2}')
  step "torch causal prefill ms" "${anchor:-n/a} (131072 tok, 32 q / 8 kv heads, d=128, bf16)"
  export WKV_PREFILL_ANCHOR_MS=${anchor:-0}
  for b in build-gpu/bin/gpu_*bench*; do
    [ -x "$b" ] || continue
    [[ "$b" == *gpu_serving_bench ]] && continue  # the serving step's
    timeout "${BENCH_TIMEOUT:-240}" "$b" > "$LOG/$(basename "$b").log" 2>&1
    step "$(basename "$b")" "rc=$? (log below)"
    tail -25 "$LOG/$(basename "$b").log"
  done
fi
if want serving; then
  # The machine's reads of mapped host memory first (the gather of missed
  # units, at a step's size and at a bandwidth-bound size, each beside a
  # cudaMemcpy from pinned memory): machines differ there most, and the
  # serving figures depend on it.
  for mib in 16 256; do
    timeout 120 build-gpu/bin/gpu_gather_bench gather --mib $mib > "$LOG/gather-probe-$mib.log" 2>&1
    step "gather probe, $mib MiB" "rc=$? $(grep -E '^\| (anchor: cudaMemcpyAsync H2D|gather, all misses \()' "$LOG/gather-probe-$mib.log" \
      | awk -F'|' '{gsub(/ +$/, "", $2); printf "%s%s %s GB/s", sep, $2, $5; sep="; "}')"
  done
  # The anchor first (PyTorch SDPA, KV on the GPU), then wavekv in the same
  # run, which prints the ratios.
  python3 bench/gpu_full_attention.py 131072 "${SERVING_BATCHES:-1,2,4,7}" > "$LOG/full-attention.log" 2>&1
  step "full attention (torch)" "rc=$? $(tr '\n' ' ' < "$LOG/full-attention.log" | cut -c1-200)"
  WKV_FULL_ATTN_MS=$(awk '/^full_ms/{printf "%s%s:%s", sep, $2, $3; sep=","}' "$LOG/full-attention.log")
  WKV_FULL_BATCH_MAX=$(awk '/^full_batch_max/{print $2}' "$LOG/full-attention.log")
  export WKV_FULL_ATTN_MS WKV_FULL_BATCH_MAX
  timeout "${BENCH_TIMEOUT:-400}" build-gpu/bin/gpu_serving_bench 131072 "${SERVING_BATCHES:-1,2,4,7}" \
    > "$LOG/serving.log" 2>&1
  step "gpu_serving_bench 128K" "rc=$?"
  tee -a "$LOG/summary.txt" < "$LOG/serving.log" | tail -20
  if [ "${SERVING_1M:-1}" != 0 ]; then
    python3 bench/gpu_full_attention.py 1048576 1 --stream > "$LOG/full-attention-1m.log" 2>&1
    WKV_FULL_ATTN_MS=$(awk '/^full_ms/{printf "%s%s:%s", sep, $2, $3; sep=","}' "$LOG/full-attention-1m.log")
    WKV_FULL_BATCH_MAX=$(awk '/^full_batch_max/{print $2}' "$LOG/full-attention-1m.log")
    WKV_STREAM_MS=$(awk '/^stream_ms/{print $2}' "$LOG/full-attention-1m.log")
    export WKV_FULL_ATTN_MS WKV_FULL_BATCH_MAX WKV_STREAM_MS
    # One run per device cache size in SERVING_1M_FRACTIONS (of the KV held;
    # 0.05 unless set): a batch of one leaves most of the GPU's memory free.
    for frac in ${SERVING_1M_FRACTIONS:-0.05}; do
      WKV_SERVING_CACHE_FRACTION=$frac timeout "${BENCH_TIMEOUT:-400}" build-gpu/bin/gpu_serving_bench 1048576 1 \
        > "$LOG/serving-1m-$frac.log" 2>&1
      step "gpu_serving_bench 1M, cache $frac" "rc=$?"
      tee -a "$LOG/summary.txt" < "$LOG/serving-1m-$frac.log" | tail -8
    done
  fi
fi
if want spill; then
  # The spill tier on the GPU: 1M tokens of Llama3-8B attention geometry
  # over SPILL_LAYERS layers, more KV than the host budget holds.
  sdir=${SPILL_DIR:-/tmp/wkv-spill}
  mkdir -p "$sdir"
  step "spill dir" "$(df -h "$sdir" | tail -1 | awk '{print $1, $2 " size,", $4 " free"}'), host $(free -g | awk '/Mem:/{print $2 " GiB, " $7 " GiB available"}')"
  if [ -z "${WKV_STREAM_MS:-}" ]; then
    python3 bench/gpu_full_attention.py 1048576 1 --stream > "$LOG/full-attention-1m.log" 2>&1
    WKV_STREAM_MS=$(awk '/^stream_ms/{print $2}' "$LOG/full-attention-1m.log")
  fi
  export WKV_STREAM_MS
  WKV_SERVING_HOST_BUDGET_GIB=${SPILL_HOST_BUDGET_GIB:-96} WKV_SERVING_SPILL_DIR="$sdir" \
    timeout "${BENCH_TIMEOUT:-540}" build-gpu/bin/gpu_serving_bench 1048576 1 "${SPILL_STEPS:-256}" \
    "${SPILL_LAYERS:-32}" > "$LOG/spill-1m.log" 2>&1
  step "gpu_serving_bench 1M spill" "rc=$?"
  tee -a "$LOG/summary.txt" < "$LOG/spill-1m.log" | tail -12
fi
if want demo; then
  # The demo's million-token case with and without spill in one run: the
  # in-memory pass needs ~21 GiB beside the demo's reference, more than a
  # 24 GiB machine holds, so it runs here, on the CPU engine.
  sdir=${SPILL_DIR:-/tmp/wkv-spill}
  mkdir -p "$sdir"
  step "demo spill dir" "$(df -h "$sdir" | tail -1 | awk '{print $1, $2 " size,", $4 " free"}'), host $(free -g | awk '/Mem:/{print $2 " GiB, " $7 " GiB available"}'), $(nproc) cores"
  tv=()
  [ -x /usr/bin/time ] && tv=(/usr/bin/time -v)  # peak resident memory, where GNU time exists
  "${tv[@]}" timeout "${BENCH_TIMEOUT:-540}" build-gpu/bin/wavekv demo --tokens "${DEMO_TOKENS:-1048576}" \
    --layers 4 --heads 8 --q-heads 32 --steps 16 --repeat 4 --threads "$(nproc)" \
    --host-budget "${DEMO_BUDGET:-4GiB}" --spill-dir "$sdir" --compare-in-memory > "$LOG/demo.log" 2>&1
  step "wavekv demo --compare-in-memory" "rc=$?"
  cp "$LOG/demo.log" "$OUT/" 2>/dev/null
  grep -v -E "ing: |ing:.*done" "$LOG/demo.log" | grep -E -v "^\s+(Page|Volun|Invol|Swaps|File sys|Socket|Signals|Average|Exit|Minor|Major|Percent|System time|User time|Command)" \
    | tee -a "$LOG/summary.txt" | tail -40
fi
if want capture; then
  # Steps a runtime captures (wkv_plan_bind): the GPU tests of the binding,
  # then the serving bench at 128K, batch CAPTURE_BATCH (7), L layers
  # (CAPTURE_LAYERS, 4), the verbs a token against the runtime's own graph
  # of the whole step replayed after a prepare, in turn over CAPTURE_ROUNDS
  # (1) rounds on this machine.
  timeout "${BENCH_TIMEOUT:-400}" build-gpu/bin/gpu_capture --gtest_brief=1 > "$LOG/gpu_capture.log" 2>&1
  step "gpu_capture" "rc=$? $(grep -E 'PASSED|FAILED' "$LOG/gpu_capture.log" | tr '\n' ' ' | cut -c1-120)"
  grep -E "Failure|Expected|Which is|actual|first|error" "$LOG/gpu_capture.log" | head -30 | tee -a "$LOG/summary.txt"
  for round in $(seq 1 "${CAPTURE_ROUNDS:-1}"); do
    for mode in 0 1; do
      WKV_SERVING_CAPTURE=$mode timeout "${BENCH_TIMEOUT:-400}" build-gpu/bin/gpu_serving_bench 131072 \
        "${CAPTURE_BATCH:-7}" 1088 "${CAPTURE_LAYERS:-4}" > "$LOG/capture-$mode-$round.log" 2>&1
      step "serving, captured=$mode, round $round" "rc=$?"
      grep -E "^ +[0-9]+ +[0-9.]+ |host us|decodes replayed" "$LOG/capture-$mode-$round.log" | tee -a "$LOG/summary.txt"
    done
  done
fi
if want policies; then
  # Interleaved rounds: the machine's drift falls on every policy alike.
  for round in $(seq 1 "${POLICY_ROUNDS:-2}"); do
    for p in ${POLICIES:-lru clock slru}; do
      WKV_CACHE_POLICY=$p timeout "${BENCH_TIMEOUT:-240}" build-gpu/bin/gpu_serving_bench 131072 \
        "${POLICY_BATCHES:-7}" > "$LOG/policy-$p-$round.log" 2>&1
      step "cache policy $p, round $round" "rc=$?"
      grep -E "^ +[0-9]+ +[0-9.]+ |cache units per layer-step" "$LOG/policy-$p-$round.log" | tee -a "$LOG/summary.txt"
    done
  done
fi
if want decode-profile && command -v ncu >/dev/null; then
  # ncu serializes the profiled kernels, so these are device times without
  # overlap (the estimate beside the gather, say): what each kernel costs,
  # not the step's critical path.
  dkern='regex:stage_|logits_kernel|select_kernel|estimate_kernel|offsets_kernel|gather_kernel|attend_kernel|combine_kernel|merge_kernel'
  for case in ${PROFILE_CASES:-131072:7 1048576:1}; do
    tok=${case%%:*} batch=${case##*:}
    frac=0.05
    [ "$tok" -ge 1048576 ] && frac=0.2
    WKV_SERVING_CACHE_FRACTION=$frac timeout "${BENCH_TIMEOUT:-300}" ncu --clock-control none \
      --metrics gpu__time_duration.sum --csv --kernel-name-base function --kernel-name "$dkern" \
      --launch-skip "${PROFILE_SKIP:-2000}" --launch-count "${PROFILE_COUNT:-1400}" \
      build-gpu/bin/gpu_serving_bench "$tok" "$batch" "${PROFILE_STEPS:-200}" 4 \
      > "$LOG/ncu-decode-$tok-$batch.csv" 2> "$LOG/ncu-decode-$tok-$batch.err"
    step "ncu decode $tok x $batch" "rc=$? (kernel, launches, median and mean us a launch)"
    python3 tools/ncu_table.py time "$LOG/ncu-decode-$tok-$batch.csv" | tee -a "$LOG/summary.txt"
    # Where the lookup's kernels wait (PROFILE_DETAIL=0: not): throughputs,
    # occupancy and the warps' stall reasons, per issued instruction, of
    # PROFILE_DETAIL_KERNELS, a few launches each (replayed per metric pass).
    [ "${PROFILE_DETAIL:-1}" = 1 ] || continue
    WKV_SERVING_CACHE_FRACTION=$frac timeout "${BENCH_TIMEOUT:-300}" ncu --clock-control none --csv \
      --kernel-name-base function --kernel-name "regex:${PROFILE_DETAIL_KERNELS:-select_kernel|logits_kernel}" \
      --launch-skip 400 --launch-count 4 \
      --metrics 'gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,dram__bytes_read.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,smsp__cycles_active.avg,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
      build-gpu/bin/gpu_serving_bench "$tok" "$batch" 120 4 \
      > "$LOG/ncu-detail-$tok-$batch.csv" 2> "$LOG/ncu-detail-$tok-$batch.err"
    step "ncu detail $tok x $batch" "rc=$? (metric: mean of the launches, per kernel)"
    python3 tools/ncu_table.py metrics "$LOG/ncu-detail-$tok-$batch.csv" | tee -a "$LOG/summary.txt"
  done
fi
if want source-profile && command -v ncu >/dev/null; then
  # Warp samples by instruction need no line information; a build with
  # CUDAFLAGS=-lineinfo lets the report (in Nsight Compute's GUI) show the
  # CUDA lines beside the SASS.
  case=${SOURCE_CASE:-1048576:1} kern=${SOURCE_KERNEL:-select_kernel}
  tok=${case%%:*} batch=${case##*:}
  frac=0.05
  [ "$tok" -ge 1048576 ] && frac=0.2
  WKV_SERVING_CACHE_FRACTION=$frac timeout "${BENCH_TIMEOUT:-300}" ncu --clock-control none \
    --kernel-name "regex:$kern" --launch-skip 200 --launch-count 1 --section SourceCounters \
    --section WarpStateStats --import-source yes -f -o "$OUT/source-$kern-$tok-$batch" \
    build-gpu/bin/gpu_serving_bench "$tok" "$batch" 80 4 > "$LOG/ncu-source.log" 2>&1
  step "ncu source $kern $tok x $batch" "rc=$? (warp samples by instruction)"
  ncu -i "$OUT/source-$kern-$tok-$batch.ncu-rep" --page source --csv --print-source sass \
    > "$LOG/source-$kern.csv" 2>> "$LOG/ncu-source.log"
  gzip -c "$LOG/source-$kern.csv" > "$OUT/source-$kern-$tok-$batch.csv.gz"
  python3 tools/ncu_table.py source "$LOG/source-$kern.csv" 30 | tee -a "$LOG/summary.txt"
fi
if want profile && command -v ncu >/dev/null; then
  # Device time of each kernel of the k-means, summed by kernel: two calls of
  # the 128-segment batch on random keys (gpu_gather_bench), and the engine's
  # first index build on the step bench's keys (gpu_step_bench).
  kern='regex:upload_segs|mean_|normalize|init_dirs|assign|argmax|bucket|update|finalize|order_kernel|centroid|Radix|Scan'
  timeout "${BENCH_TIMEOUT:-240}" ncu --clock-control none --metrics gpu__time_duration.sum --csv \
    --kernel-name-base function --kernel-name "$kern" \
    build-gpu/bin/gpu_gather_bench kmeans-profile > "$LOG/ncu-kmeans.csv" 2> "$LOG/ncu-kmeans.err"
  step "ncu k-means, random keys" "rc=$? (kernel, launches, ms per batch of 128 segments)"
  python3 tools/ncu_table.py sum "$LOG/ncu-kmeans.csv" 2 | tee -a "$LOG/summary.txt"
  timeout "${BENCH_TIMEOUT:-240}" ncu --clock-control none --metrics gpu__time_duration.sum --csv \
    --kernel-name-base function --kernel-name "$kern" --launch-count 400 \
    build-gpu/bin/gpu_step_bench > "$LOG/ncu-step.csv" 2> "$LOG/ncu-step.err"
  step "ncu k-means, step bench keys" "rc=$? (kernel, launches, ms per index build; two builds)"
  python3 tools/ncu_table.py sum "$LOG/ncu-step.csv" 2 | tee -a "$LOG/summary.txt"
fi
echo
cat "$LOG/summary.txt"

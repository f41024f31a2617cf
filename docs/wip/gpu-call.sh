#!/bin/bash
# One device call for kernel work of issue 9 (docs/wip/README.md): run on
# the GPU machine from the repository root, with the changes under test in
# the working tree:
#
#   # device call, kind nvidia-h200 or nvidia-h100-x1 (whichever status
#   # shows no refusal window for), carrying .debs:
#   LIMIT=585 bash docs/wip/gpu-call.sh
#
# To compare with main's code instead of (or beside) the variants below,
# unpack it beside the tree and carry it too (docs/gpu-machine.md):
#   rm -rf build-base-src && mkdir build-base-src && git archive HEAD | tar -x -C build-base-src
# and add "BENCH=build-base-src/build-gpu/bin/gpu_serving_bench" to an A/B
# after building it there (as the eighth session's version of this script
# did: git log -p docs/wip/gpu-call.sh).
#
# PHASE=one's A/B settings are the ninth session's (the value sums' f16
# copy against WKV_VALUE_SUM16=0, the estimate at the caller's priority);
# PHASE=time's are the next experiment's (the register bounds); edit them
# for the change at hand.
# PHASE=verify: every target, the GPU suite, memcheck of the 8-bit row
# writers, racecheck of the lookup tests three at a time (RACE_FILTER).
# PHASE=race: racecheck of RACE_TESTS ("program:filter" words; the two
# capture tests racecheck has not finished), then of the lookup tests
# (RACE_FILTER), PAR (2) at a time, with the call's time left.
# PHASE=racesuite: every target, then the GPU suite beside racecheck of
# RACE_TESTS.
# PHASE=host: the host's time a layer at batch 7, the tree's bench against
# build-base-src's (the same machine, interleaved); then 128K at batch 13
# against full attention with the trades 6x might take (a smaller
# retrieval zone, larger clusters, a larger device cache).
# PHASE=hostrows: placement, the head-state and Python CUDA tests, the f32
# meta rows in host memory at 1M, memcheck of their tests (about 300 s).
# PHASE=m32: 1M tokens, batch 1, all 32 layers (8-bit pages fit host
# memory), against full attention streaming from host memory.
# PHASE=smt: where cores have two threads, placement (the host's time at
# batch 7 with its threads' CPUs sampled); on a host with one thread a
# core it ends at once.
# PHASE=marked: docs/wip/marked-copies.patch (an append of up to 256
# copies and 64 sequences in one launch, with large kernel parameters)
# against the tree without it: the tree is copied to build-base-src/ first,
# then patched; both built; TableCuda.* and gpu_batch on the patched tree;
# the host's time a layer at batch 13 and 7, interleaved base and patched
# (PLACE_ROUNDS, 2); memcheck of the kernel's test. About 300 s.
# PHASE=racecap: racecheck of the two capture tests side by side, the
# head-state tests, memcheck of the f32 meta rows in host memory, the
# Python CUDA tests.
# (PHASE=place, the sixteenth session's first call: the host memory pools
# probed, the host's time at batch 7 with and without taskset, the three
# trades together at batch 13; git log -p. hostrows took its place.)
# PHASE=serve128: 128K against full attention in the same call (8-bit
# pages, batch 7 and 13; batch 7 with WKV_META_ROWS=16), then ncu's times
# of the step's kernels at batch 7.
# PHASE=quick (about 300 s): the tree's bench and lookup tests; two A/B
# rounds of its meta rows in 8 bits (the default) against 16
# (WKV_META_ROWS=16); ncu of the logits and the estimate both ways.
# PHASE=land: what landing the pending changes needs when the budget
# allows one call (docs/wip/README.md): every target,
# one A/B round, ncu of the logits, the GPU suite, memcheck of the lookup
# tests.
# PHASE=one: every target of the tree, one A/B round within it, the GPU
# suite (ctest -R gpu_), then memcheck of the lookup tests a test at a
# time; what the ninth session ran (268 s on an H100), for a budget that
# may allow one call only.
# PHASE=time (the default): the bench and the lookup, head-state and batch
# tests of the tree, and its bench built again under each variant's
# CUDAFLAGS (the gather's register bound, the estimate's
# CTA size); two A/B
# rounds at 1M, 8-bit pages, a 20% device cache; the tests; ncu of the
# step's kernels; ncu's sections of each kernel. Needs no build-base-src.
# PHASE=suite (a second call, on the machine the first left warm): builds
# every target, runs the GPU suite, then memcheck and racecheck of the
# lookup tests a test at a time, with the time left (racecheck takes more
# than 120 s for some of them).
# LIMIT: the call's seconds; steps that would pass it are skipped. Logs go
# to $OUT/logs.tar.gz after each step.
set -u
OUT=${OUT:-$PWD/gpu-call-logs}
mkdir -p "$OUT"
T0=$SECONDS
LIMIT=${LIMIT:-590}
PHASE=${PHASE:-time}
left() { echo $((LIMIT - 10 - (SECONDS - T0))); }
pack() { tar -czf $OUT/logs.tar.gz -C /tmp $(cd /tmp && ls -d build-*.txt build-*.ps lookup-tests*.txt head-tests.txt batch-tests.txt ab ctest-gpu.txt san ncu-*.csv ncu-sections.txt 2>/dev/null); }
t() { echo "$1 rc=$2 $((SECONDS-T0)) s $(grep -E '^\[  (PASSED|FAILED)|tests ran' $3 | tr '\n' ' ')"; grep -E "Failure|FAILED  \]" $3 | head -5; }
# build_all: every target of the tree. gpu_suite N: ctest -R gpu_, ending
# N s before the limit's margin. sanitize_lookup TOOLS: the lookup tests
# under those compute-sanitizer tools, a test at a time (gpu-check.sh's
# sanitize step, its logs in /tmp/san).
build_all() {
  JOBS=16 OUT=/tmp/cur tools/gpu-check.sh build > /tmp/build-all.txt 2>&1; echo "build all rc=$? $((SECONDS-T0)) s"
  grep -hE "error" -A3 /tmp/build-all.txt | head -20
}
gpu_suite() {
  [ "$(left)" -gt 60 ] || return
  (cd build-gpu && timeout $(( $(left) - $1 )) ctest -R gpu_ --output-on-failure -j3 --timeout 200) > /tmp/ctest-gpu.txt 2>&1
  echo "ctest gpu_ rc=$? $((SECONDS-T0)) s"; grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)|Not Run" /tmp/ctest-gpu.txt | head -20
  grep -cE "Test +#[0-9]+: .*Passed" /tmp/ctest-gpu.txt
}
sanitize_lookup() {
  [ "$(left)" -gt 25 ] && SANITIZER_TOOLS="$1" SANITIZER_TESTS=gpu_lookup_attention SANITIZER_PER_TEST=1 \
    SANITIZER_TIMEOUT=120 OUT=/tmp/san timeout $(left) tools/gpu-check.sh sanitize
}
# san_one TOOL PROGRAM FILTER TIMEOUT: one program's tests matching FILTER
# (all: every test) under that compute-sanitizer tool, its log in /tmp/san.
san_one() {
  # Time left: the call's, or (in san_list's processes, where SECONDS
  # starts again) until the exported END, in seconds since the epoch.
  local l; if [ -n "${END:-}" ]; then l=$((END - $(date +%s))); else l=$(left); fi
  [ "$l" -gt 20 ] || return
  local f=(); [ "$3" = all ] || f=(--gtest_filter="$3")
  local to=$4; [ "$to" -lt "$l" ] || to=$l
  mkdir -p /tmp/san
  local log="/tmp/san/$1-$2-$(echo "$3" | tr -c 'A-Za-z0-9_.\n' '_').log"
  WKV_TEST_UNDER_SANITIZER=$1 timeout "$to" compute-sanitizer --tool "$1" --report-api-errors no --error-exitcode 9 \
    "build-gpu/bin/$2" --gtest_brief=1 "${f[@]}" > "$log" 2>&1
  echo "$1 $2 $3 rc=$? $(date +%T) $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)"
}
# san_list TOOL TIMEOUT: san_one of each "PROGRAM FILTER" line of stdin,
# PAR (3) at a time, each under TIMEOUT.
san_list() {
  END=$(( $(date +%s) + $(left) )); export -f san_one; export END
  xargs -P "${PAR:-3}" -L 1 bash -c 'san_one '"$1"' "$0" "$1" '"$2"
}
# san_par TOOL PROGRAM FILTER TIMEOUT: san_list of each test of PROGRAM
# that FILTER matches.
san_par() {
  [ "$(left)" -gt 30 ] || return
  "build-gpu/bin/$2" --gtest_list_tests --gtest_filter="$3" | awk '/^[^ ]/{s=$1} /^  /{print s $1}' \
    | sed "s/^/$2 /" | san_list "$1" "$4"
}
# variant NAME FLAGS: the tree's bench built again in build-var-NAME/ (a
# copy of the tree) with CUDAFLAGS=FLAGS at configure.
variant() {
  rm -rf "build-var-$1" && mkdir "build-var-$1" && tar -c --exclude='./build*' --exclude=./.debs --exclude=./.git . | tar -x -C "build-var-$1"
  (cd "build-var-$1" && ln -sfn ../.debs .debs && CUDAFLAGS="$2" JOBS=${VAR_JOBS:-3} BUILD_TARGETS=gpu_serving_bench OUT=/tmp/var-$1 tools/gpu-check.sh build > /tmp/build-var-$1.txt 2>&1; echo "build $1 rc=$? $((SECONDS-T0)) s")
}
# ncu_kernels NAME BIN REGEX COUNT: ncu's times of the step's kernels.
ncu_kernels() {
  timeout 60 ncu --clock-control none --metrics gpu__time_duration.sum \
    --csv --kernel-name-base function --kernel-name regex:"$3" \
    --launch-skip 400 --launch-count "$4" "$2" 1048576 1 80 4 > /tmp/ncu-$1.csv 2>/dev/null
  echo "ncu $1 rc=$? $((SECONDS-T0)) s"; python3 tools/ncu_table.py time /tmp/ncu-$1.csv | head -8
}
# ab ROUNDS NEED SETTING...: tools/gpu-ab.sh's rounds of the settings at
# 1M, batch 1, 8-bit pages, a 20% device cache, where NEED s are left.
ab() {
  local rounds=$1 need=$2
  shift 2
  [ "$(left)" -gt "$need" ] && WKV_PAGE_FORMAT=1 WKV_SERVING_CACHE_FRACTION=0.2 ROUNDS=$rounds OUT=/tmp/ab \
    BENCH_TIMEOUT=${BENCH_TIMEOUT:-60} tools/gpu-ab.sh "$@" -- 1048576 1 2>&1 | grep -E "^==|^ +[0-9]+ +[0-9.]+ |device us \(med|host us"
  echo "ab $((SECONDS-T0)) s"
}
# ncu_of NEED REGEX COUNT NAME...: ncu_kernels of each build (cur: the
# tree's; else build-var-NAME's) while NEED s are left.
ncu_of() {
  local need=$1 regex=$2 count=$3 which bin
  shift 3
  for which in "$@"; do
    [ "$(left)" -gt "$need" ] || break
    bin=build-gpu/bin/gpu_serving_bench; [ "$which" = cur ] || bin=build-var-$which/$bin
    WKV_PAGE_FORMAT=1 WKV_SERVING_CACHE_FRACTION=0.2 ncu_kernels "$which" "$bin" "$regex" "$count"
  done
}
# race_lines: "PROGRAM FILTER" for each word of RACE_TESTS (by default the
# two capture tests racecheck has not finished), for san_list.
race_lines() {
  local t
  for t in ${RACE_TESTS:-gpu_capture:GpuCapture.ALoopOfPreparesAndReplaysNeverWaitsForTheStream gpu_capture:GpuCapture.ReplaysStayExactAcrossGrowths}; do
    echo "${t%%:*} ${t#*:}"
  done
}
# race_phases: where each long test's time went under racecheck
# (SanitizerPhases' lines), by log.
race_phases() { grep -H "\[sanitizer\]" /tmp/san/*.log | sed 's|^/tmp/san/racecheck-||' | tail -40; }
# full_attention TIMEOUT BATCHES: full attention at 128K (PyTorch SDPA),
# its figures exported for the bench's ratios (WKV_FULL_ATTN_MS,
# WKV_FULL_BATCH_MAX).
full_attention() {
  timeout "$1" python3 bench/gpu_full_attention.py 131072 "$2" > /tmp/build-full.txt 2>&1
  echo "full attention rc=$? $((SECONDS-T0)) s"; grep -vE "Warning|warn" /tmp/build-full.txt | head
  WKV_FULL_ATTN_MS=$(awk '/^full_ms/{printf "%s%s:%s", sep, $2, $3; sep=","}' /tmp/build-full.txt)
  WKV_FULL_BATCH_MAX=$(awk '/^full_batch_max/{print $2}' /tmp/build-full.txt)
  export WKV_FULL_ATTN_MS WKV_FULL_BATCH_MAX
}
# build_some TARGETS: those targets of the tree, JOBS=16.
build_some() {
  (JOBS=16 BUILD_TARGETS="$1" OUT=/tmp/cur tools/gpu-check.sh build > /tmp/build-cur.txt 2>&1; echo "build rc=$? $((SECONDS-T0)) s")
  grep -hE "error" -A3 /tmp/build-cur.txt | head -20
}
# hostrows_tests: gpu_head_state and the Python binding's CUDA tests.
hostrows_tests() {
  timeout 120 build-gpu/bin/gpu_head_state --gtest_brief=1 > /tmp/head-tests.txt 2>&1; t gpu_head_state $? /tmp/head-tests.txt
  PYTHONPATH=bindings/python WAVEKV_LIBRARY=$PWD/build-gpu/lib/libwavekv.so PYTHONDONTWRITEBYTECODE=1 timeout 150 \
    python3 -m pytest -q -rs -p no:cacheprovider bindings/python/tests/test_cuda.py > /tmp/build-pytest-cuda.txt 2>&1
  echo "pytest test_cuda.py rc=$? $((SECONDS-T0)) s"; tail -3 /tmp/build-pytest-cuda.txt
}
# metarows_1m NEED NOTE: 1M tokens, batch 1, 8-bit pages, a 20% device
# cache, with the f32 meta rows on the device and in host memory
# (WKV_SERVING_HOST_META_ROWS): device and host memory, step, error; each
# while more than NEED s are left.
metarows_1m() {
  local m
  for m in 0 1; do
    [ "$(left)" -gt $(( $1 + 20 )) ] || break
    WKV_SERVING_HOST_META_ROWS=$m WKV_PAGE_FORMAT=1 WKV_SERVING_CACHE_FRACTION=0.2 timeout $(( $(left) - 10 )) \
      build-gpu/bin/gpu_serving_bench 1048576 1 80 4 > /tmp/build-metarows-$m.txt 2>&1
    echo "== 1M, host meta rows $m$2: rc=$? $((SECONDS-T0)) s"; grep -E "^ *(batch|1) +|rror" /tmp/build-metarows-$m.txt | cut -c1-220 | head -4
  done
}
# placement: the bench at 128K, batch 7, PLACE_ROUNDS (3) times without
# binding and bound to one logical CPU a core, interleaved, with its busy
# threads' CPUs sampled every second (the decoding thread, wkv-buffers; the
# bench is timeout's child, and pcpu a thread's average over its life).
placement() {
  lscpu | grep -E "Model name|Thread|Core|Socket|NUMA node|L3"
  for c in 0 1 2 8 15; do echo "cpu$c siblings $(cat /sys/devices/system/cpu/cpu$c/topology/thread_siblings_list 2>/dev/null)"; done
  one=$(for c in /sys/devices/system/cpu/cpu[0-9]*; do cut -d, -f1 $c/topology/thread_siblings_list | cut -d- -f1; done | sort -un | paste -sd,)
  echo "one logical CPU a core: $one"
  for i in $(seq ${PLACE_ROUNDS:-3}); do
    for which in none one; do
      [ "$(left)" -gt 40 ] || break
      pre=""; [ "$which" = one ] && pre="taskset -c $one"
      f=/tmp/build-place-$which-$i.txt
      WKV_PAGE_FORMAT=1 timeout 60 $pre build-gpu/bin/gpu_serving_bench 131072 7 > $f 2>&1 &
      pid=$!
      while kill -0 $pid 2>/dev/null; do
        ps -L -o comm=,psr=,pcpu= --ppid $pid 2>/dev/null | sort -k3 -nr | head -3 | awk '{printf "%s@%s(%s%%) ", $1, $2, $3}' >> $f.ps; echo >> $f.ps; sleep 1
      done
      wait $pid; echo "== $which, run $i: rc=$? $((SECONDS-T0)) s"
      grep -E "^ +7 +[0-9]|host us \(medians\)" $f | cut -c1-120
      tail -3 $f.ps | cut -c1-150
    done
  done
}
export LD_LIBRARY_PATH=/tmp/wkv-debs/usr/lib/x86_64-linux-gnu
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader

if [ "$PHASE" = verify ]; then
  # Landing a kernel change and widening the sanitizers' cover: every
  # target, the GPU suite, memcheck of the 8-bit row writers (page writes,
  # span quantization), then racecheck of every gpu_lookup_attention test,
  # PAR at a time, with the time left.
  build_all
  gpu_suite 200
  pack
  for t in "gpu_int8_pages all" "gpu_kmeans_gather ApplySpans.*"; do
    san_one memcheck ${t% *} "${t#* }" 120
  done
  pack
  san_par racecheck gpu_lookup_attention "${RACE_FILTER:-*}" 150
elif [ "$PHASE" = race ]; then
  # Racecheck of RACE_TESTS (program:filter ...), PAR at a time, then of
  # the lookup tests (reduced under the sanitizer: sanitized_case), with the
  # call's time left; on a fresh machine, their programs built first.
  [ -x build-gpu/bin/gpu_capture ] || (JOBS=16 BUILD_TARGETS="gpu_capture gpu_lookup_attention" OUT=/tmp/cur \
    tools/gpu-check.sh build > /tmp/build-cur.txt 2>&1; echo "build rc=$? $((SECONDS-T0)) s")
  # The lookup tests as they run without the sanitizer, beside it.
  (timeout 200 build-gpu/bin/gpu_lookup_attention --gtest_brief=1 > /tmp/lookup-tests.txt 2>&1; t "gpu_lookup_attention (plain)" $? /tmp/lookup-tests.txt) &
  { race_lines
  build-gpu/bin/gpu_lookup_attention --gtest_list_tests --gtest_filter="${RACE_FILTER:-LookupZones.*:AttendRagged.*:MergeEstimate.*}" \
    | awk '/^[^ ]/{s=$1} /^  /{print "gpu_lookup_attention " s $1}'
  } | PAR=${PAR:-2} san_list racecheck $(( $(left) - 5 ))
  wait
  race_phases
  pack
elif [ "$PHASE" = racesuite ]; then
  # Every target, then the GPU suite and racecheck of RACE_TESTS side by
  # side (PAR at a time), for a budget that allows one call for both.
  build_all
  pack
  gpu_suite 10 &
  race_lines | PAR=${PAR:-2} san_list racecheck $(( $(left) - 5 ))
  wait
  race_phases
  pack
elif [ "$PHASE" = host ]; then
  # The host's time a layer at batch 7 without a runtime's graph (the
  # issue's 30 us): the tree's bench against the code unpacked in
  # build-base-src/ (carried; the header says how), interleaved on one
  # machine, both built beside each other with every other target of the
  # tree (for PHASE=suite's call on the machine this one leaves warm).
  (cd build-base-src && ln -sfn ../.debs .debs && JOBS=${BASE_JOBS:-6} BUILD_TARGETS=gpu_serving_bench OUT=/tmp/base \
    tools/gpu-check.sh build > /tmp/build-base.txt 2>&1; echo "build base rc=$? $((SECONDS-T0)) s") &
  (JOBS=10 OUT=/tmp/cur tools/gpu-check.sh build > /tmp/build-all.txt 2>&1; echo "build all rc=$? $((SECONDS-T0)) s") &
  wait
  grep -hE "error" -A3 /tmp/build-*.txt | head -20
  for i in 1 2; do
    for which in base cur; do
      [ "$(left)" -gt 60 ] || break
      bin=build-gpu/bin/gpu_serving_bench; [ "$which" = base ] && bin=build-base-src/$bin
      WKV_PAGE_FORMAT=1 timeout 90 "$bin" 131072 7 > /tmp/build-host-$which-$i.txt 2>&1
      echo "== $which, run $i: rc=$? $((SECONDS-T0)) s"
      grep -E "^ +7 +[0-9]|host us \(medians\)|buffer manager" /tmp/build-host-$which-$i.txt | cut -c1-200
    done
  done
  pack
  # What 6x at 128K would cost (the trades a deployment may choose, none a
  # default): batch 13 at the defaults, then with half the retrieval zone,
  # 32-token clusters and a 10% device cache (each, then together), against
  # full attention's best from the same call; each run's error against
  # exact attention beside its speed.
  full_attention 120 4
  for e in "WKV_PAGE_FORMAT=1" "WKV_RETRIEVAL_FRAC=0.009" "WKV_CLUSTER_TOKENS=32" "WKV_SERVING_CACHE_FRACTION=0.1" \
    "WKV_RETRIEVAL_FRAC=0.009 WKV_SERVING_CACHE_FRACTION=0.1" \
    "WKV_RETRIEVAL_FRAC=0.009 WKV_CLUSTER_TOKENS=32 WKV_SERVING_CACHE_FRACTION=0.1"; do
    [ "$(left)" -gt 70 ] || break
    f=/tmp/build-trade-$(echo "$e" | tr -c 'A-Za-z0-9.\n' '_').txt
    env WKV_PAGE_FORMAT=1 $e timeout $(( $(left) - 10 )) build-gpu/bin/gpu_serving_bench 131072 13 > "$f" 2>&1
    echo "== batch 13, $e: rc=$? $((SECONDS-T0)) s"
    grep -E "^ +13 +[0-9]|^full|vs full|best" "$f" | cut -c1-200
  done
  pack
elif [ "$PHASE" = marked ]; then
  rm -rf build-base-src && mkdir build-base-src
  tar --exclude=./.debs --exclude=./build-gpu --exclude=./build-base-src --exclude=./build --exclude=./build-asan --exclude=./build-tsan \
    -cf - . | tar -xf - -C build-base-src
  (git apply docs/wip/marked-copies.patch 2>/dev/null || patch -p1 < docs/wip/marked-copies.patch) \
    && echo "patched" || { echo "the patch did not apply"; exit 1; }
  (cd build-base-src && ln -sfn ../.debs .debs && JOBS=${BASE_JOBS:-6} BUILD_TARGETS=gpu_serving_bench OUT=/tmp/base \
    tools/gpu-check.sh build > /tmp/build-base.txt 2>&1; echo "build base rc=$? $((SECONDS-T0)) s") &
  (JOBS=10 BUILD_TARGETS="gpu_serving_bench gpu_kmeans_gather gpu_batch gpu_head_state wavekv" OUT=/tmp/cur tools/gpu-check.sh build \
    > /tmp/build-cur.txt 2>&1; echo "build rc=$? $((SECONDS-T0)) s") &
  wait
  grep -hE "error" -A3 /tmp/build-*.txt | head -20
  timeout 60 build-gpu/bin/gpu_kmeans_gather --gtest_filter='TableCuda.*' > /tmp/build-table.txt 2>&1
  t TableCuda $? /tmp/build-table.txt
  timeout 150 build-gpu/bin/gpu_batch --gtest_brief=1 > /tmp/batch-tests.txt 2>&1; t gpu_batch $? /tmp/batch-tests.txt
  for i in $(seq ${PLACE_ROUNDS:-2}); do
    for b in 13 7; do
      for which in base cur; do
        [ "$(left)" -gt 60 ] || break
        bin=build-gpu/bin/gpu_serving_bench; [ "$which" = base ] && bin=build-base-src/$bin
        WKV_PAGE_FORMAT=1 timeout 90 "$bin" 131072 $b > /tmp/build-marked-$which-$b-$i.txt 2>&1
        echo "== batch $b, $which, run $i: rc=$? $((SECONDS-T0)) s"
        grep -E "^ +$b +[0-9]|host us \(medians\)|device us" /tmp/build-marked-$which-$b-$i.txt | cut -c1-200
      done
    done
  done
  san_one memcheck gpu_kmeans_gather 'TableCuda.*' 120; tail -2 /tmp/san/memcheck-gpu_kmeans_gather-*.log
  # The head-state tests (the eighteenth session's failed growths and
  # imports with the meta rows in host memory among them) and the Python
  # binding's CUDA tests, on the patched tree.
  [ "$(left)" -gt 150 ] && hostrows_tests
  pack
elif [ "$PHASE" = m32 ]; then
  # 1M tokens, batch 1, all 32 layers in host memory (8-bit pages: about
  # 66 GiB of KV), a 20% device cache, the f32 meta rows in host memory
  # (M32_HOST_ROWS, 1), against full attention streaming one layer's KV
  # from pinned host memory (the same call): the issue's 1M figure without
  # scaling 4 layers by 8.
  build_some "gpu_serving_bench"
  free -g | head -2
  timeout 120 python3 bench/gpu_full_attention.py 1048576 1 --stream > /tmp/build-full-1m.txt 2>&1
  echo "full attention 1M rc=$? $((SECONDS-T0)) s"; grep -E "^stream_ms|^full" /tmp/build-full-1m.txt | head -4
  WKV_STREAM_MS=$(awk '/^stream_ms/{print $2}' /tmp/build-full-1m.txt); export WKV_STREAM_MS
  WKV_SERVING_HOST_META_ROWS=${M32_HOST_ROWS:-1} WKV_PAGE_FORMAT=1 WKV_SERVING_CACHE_FRACTION=0.2 \
    timeout $(( $(left) - 5 )) build-gpu/bin/gpu_serving_bench 1048576 1 64 32 > /tmp/build-m32.txt 2>&1
  echo "== 1M, 32 layers: rc=$? $((SECONDS-T0)) s"; grep -vE "^ *$" /tmp/build-m32.txt | tail -14 | cut -c1-220
  free -g | head -2
  pack
elif [ "$PHASE" = smt ]; then
  # The host's slow mode where cores have two threads: nothing to learn on
  # a host with one thread a core, so such a host ends the call at once;
  # otherwise the bench, then placement (PLACE_ROUNDS) with the threads'
  # CPUs and their siblings.
  lscpu | grep -E "Model name|Thread|Core\(s\)|NUMA node\(s\)"
  if [ "$(lscpu | awk -F: '/^Thread\(s\) per core/{gsub(/ /, "", $2); print $2}')" = 1 ]; then
    echo "one thread a core: no siblings to share, nothing to sample"
  else
    build_some "gpu_serving_bench"
    placement
    for c in $(seq 0 15); do echo "cpu$c: $(cat /sys/devices/system/cpu/cpu$c/topology/thread_siblings_list 2>/dev/null)"; done | paste -sd' '
  fi
  pack
elif [ "$PHASE" = hostrows ]; then
  # The least that verifies the f32 meta rows in host memory and samples
  # the host's threads, for a call of about 300 s: the head-state and
  # Python CUDA tests, placement (PLACE_ROUNDS), the two at 1M, memcheck of
  # the head-state tests of the flag.
  build_some "gpu_head_state wavekv gpu_serving_bench"
  hostrows_tests
  pack
  placement
  pack
  metarows_1m 60 ""
  pack
  san_one memcheck gpu_head_state 'GpuHeadState.MetaRows*' 150
elif [ "$PHASE" = racecap ]; then
  # Racecheck of RACE_TESTS (the two capture tests that cross growths, side
  # by side) with the call's time, after placement where PLACE=1; beside
  # racecheck the two at 1M (memory and error: their step times are not
  # figures there), the head-state and Python CUDA tests, memcheck of the
  # flag's tests.
  build_some "gpu_capture gpu_head_state wavekv gpu_serving_bench"
  [ "${PLACE:-0}" = 1 ] && placement
  pack
  race_lines | PAR=2 san_list racecheck $(( $(left) - 5 )) &
  metarows_1m 0 " (beside racecheck)"
  hostrows_tests
  san_one memcheck gpu_head_state 'GpuHeadState.MetaRows*' 200
  pack
  wait
  race_phases
  pack
elif [ "$PHASE" = serve128 ]; then
  # 128K against full attention in one call (the 6x target): the gather's
  # host reads, the anchor, 8-bit pages at batch 7 and 13, batch 7 with the
  # meta rows in 16 bits, then ncu's times of the step's kernels at batch 7.
  (JOBS=16 BUILD_TARGETS="gpu_serving_bench gpu_gather_bench" OUT=/tmp/cur tools/gpu-check.sh build > /tmp/build-cur.txt 2>&1; echo "build cur rc=$? $((SECONDS-T0)) s")
  grep -hE "error" -A3 /tmp/build-*.txt | head -20
  timeout 60 build-gpu/bin/gpu_gather_bench gather --mib 16 > /tmp/build-probe.txt 2>&1
  grep -E '^\| (anchor: cudaMemcpyAsync H2D|gather, all misses \()' /tmp/build-probe.txt
  full_attention 150 4,7
  for run in "7,13 " "7 WKV_META_ROWS=16" "7 "; do
    b=${run%% *} e=${run#* }
    [ "$(left)" -gt 100 ] || break
    env $e WKV_PAGE_FORMAT=1 timeout 200 build-gpu/bin/gpu_serving_bench 131072 $b > /tmp/build-serve-$b-${e:-8}.txt 2>&1
    echo "== batches $b ${e:-meta rows 8} rc=$? $((SECONDS-T0)) s"; grep -vE "^#|^$" /tmp/build-serve-$b-${e:-8}.txt | tail -12
  done
  pack
  [ "$(left)" -gt 120 ] && WKV_PAGE_FORMAT=1 PROFILE_CASES=131072:7 PROFILE_DETAIL=0 BENCH_TIMEOUT=$(( $(left) - 20 )) \
    OUT=/tmp/prof tools/gpu-check.sh decode-profile 2>&1 | tail -14
elif [ "$PHASE" = quick ]; then
  # The least that times a change of the lookup, for a call of about 300 s.
  (JOBS=16 BUILD_TARGETS="gpu_serving_bench gpu_lookup_attention" OUT=/tmp/cur tools/gpu-check.sh build > /tmp/build-cur.txt 2>&1; echo "build cur rc=$? $((SECONDS-T0)) s")
  grep -hE "error" -A3 /tmp/build-*.txt | head -20
  ab 2 100 '' 'WKV_META_ROWS=16'
  pack
  [ "$(left)" -gt 30 ] && { timeout $(left) build-gpu/bin/gpu_lookup_attention --gtest_brief=1 > /tmp/lookup-tests.txt 2>&1; t gpu_lookup_attention $? /tmp/lookup-tests.txt; }
  pack
  ncu_of 40 'logits_kernel|estimate_kernel' 24 cur
  WKV_META_ROWS=16 ncu_of 40 'logits_kernel|estimate_kernel' 24 cur
elif [ "$PHASE" = land ]; then
  # What landing a change of the kernels needs, in one call: every target
  # of the tree; one A/B round; the GPU suite; ncu's times of the logits,
  # the select and the estimate; memcheck of the lookup tests with the
  # time left.
  build_all
  # The tree's meta rows in 8 bits (the default) against 16.
  ab 1 200 '' 'WKV_META_ROWS=16'
  pack
  gpu_suite 60
  pack
  ncu_of 60 'logits_kernel|select_kernel|estimate_kernel' 40 cur
  pack
  sanitize_lookup memcheck
elif [ "$PHASE" = one ]; then
  # Time and suite in one call, where the budget allows one: every target
  # of the patched tree; the A/B within it (value sums f16 and f32 twice,
  # the estimate at the caller's priority once; main's step against the
  # patches is the eighth session's), the GPU suite, then memcheck of the
  # lookup tests with the time left.
  build_all
  BENCH_TIMEOUT=80 ab 1 250 '' 'WKV_VALUE_SUM16=0' '' 'WKV_VALUE_SUM16=0' 'WKV_DECODE_SIDE_LEVELS=9
  pack
  gpu_suite 30
  pack
  sanitize_lookup memcheck
elif [ "$PHASE" = time ]; then
  # The tree's bench and tests, and its bench built again under each
  # variant's CUDAFLAGS (a copy of the tree a variant, build-var-<name>/):
  # g3, the gather bounded to 80
  # registers (WKV_GATHER_MIN_CTAS=3); e128g3, with the estimate's CTAs of
  # 128 threads (WKV_ESTIMATE_THREADS=128): the estimate's CTAs and two of
  # the gather's fit a multiprocessor's registers without the estimate
  # spilling (docs/gpu-serving.md, "The estimate beside the gather,
  # priced"; WKV_ESTIMATE_MIN_CTAS=4 is the other way, with spills); s16,
  # the select split over 16 CTAs a run (WKV_SELECT_MAX_SPLIT=16: 128 CTAs
  # at batch 1 instead of 64).
  (JOBS=7 BUILD_TARGETS="gpu_serving_bench gpu_lookup_attention gpu_batch gpu_head_state" OUT=/tmp/cur tools/gpu-check.sh build > /tmp/build-cur.txt 2>&1; echo "build cur rc=$?") &
  variant g3 "-DWKV_GATHER_MIN_CTAS=3" &
  variant e128g3 "-DWKV_ESTIMATE_THREADS=128 -DWKV_GATHER_MIN_CTAS=3" &
  variant s16 "-DWKV_SELECT_MAX_SPLIT=16" &
  wait; echo "builds $((SECONDS-T0)) s"; grep -hE "error" -A3 /tmp/build-*.txt | head -20
  v=build-gpu/bin/gpu_serving_bench
  BENCH_TIMEOUT=80 ab 2 200 '' "BENCH=build-var-g3/$v" "BENCH=build-var-e128g3/$v" "BENCH=build-var-s16/$v"
  pack
  # The tests read no WKV_* variable.
  [ "$(left)" -gt 60 ] && { timeout $(left) build-gpu/bin/gpu_lookup_attention --gtest_brief=1 > /tmp/lookup-tests.txt 2>&1; t gpu_lookup_attention $? /tmp/lookup-tests.txt; }
  [ "$(left)" -gt 20 ] && { timeout $(left) build-gpu/bin/gpu_head_state --gtest_brief=1 > /tmp/head-tests.txt 2>&1; t gpu_head_state $? /tmp/head-tests.txt; }
  [ "$(left)" -gt 20 ] && { timeout $(left) build-gpu/bin/gpu_batch --gtest_brief=1 > /tmp/batch-tests.txt 2>&1; t gpu_batch $? /tmp/batch-tests.txt; }
  # ncu: the step's kernels of the tree and of main's logits.
  ncu_of 110 'select_kernel|logits_kernel|estimate_kernel|gather_kernel|attend|combine' 180 cur
  export WKV_PAGE_FORMAT=1 WKV_SERVING_CACHE_FRACTION=0.2
  # One launch each of the step's kernels under ncu's sections (where the
  # time goes inside them: throughput, occupancy, stalls), for the next
  # kernel work; the text is in the logs.
  if [ "$(left)" -gt 120 ]; then
    timeout 90 ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
      --section LaunchStats --section WarpStateStats --section SchedulerStats --kernel-name-base function \
      --kernel-name regex:'logits_kernel|select_kernel|estimate_kernel|gather_kernel|attend|combine|stage' \
      --launch-skip 400 --launch-count 8 build-gpu/bin/gpu_serving_bench 1048576 1 80 4 > /tmp/ncu-sections.txt 2>&1
    echo "ncu sections rc=$? $((SECONDS-T0)) s"
    grep -E "^  [a-z_:<>0-9A-Z]+.*\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Theoretical Occ|No Eligible|Block Limit Reg" /tmp/ncu-sections.txt | head -80
  fi
  unset WKV_PAGE_FORMAT WKV_SERVING_CACHE_FRACTION
  pack
else
  build_all
  gpu_suite 45
  pack
  sanitize_lookup "memcheck racecheck"
fi
pack
echo "done $((SECONDS-T0)) s"

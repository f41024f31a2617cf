#!/usr/bin/env bash
# Builds wavekv on a GPU machine, runs every test (GPU suites included), the
# GPU suites again under compute-sanitizer, and the GPU benchmarks, then
# prints a short table. Logs go to $OUT (or ./gpu-check-logs).
#
# The machine needs nvcc and CMake; libraries it lacks (liburing, mimalloc,
# GoogleTest, oneTBB, xxHash) may come as Debian packages in .debs/ (see
# the device notes in docs/), unpacked under a prefix here.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$PWD/gpu-check-logs}
mkdir -p "$OUT"
JOBS=${JOBS:-$(nproc)}

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

step() { printf '%-28s %s\n' "$1" "$2" | tee -a "$OUT/summary.txt"; }
: > "$OUT/summary.txt"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DWKV_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  > "$OUT/configure.log" 2>&1 && cmake --build build-gpu -j"$JOBS" > "$OUT/build.log" 2>&1
build_rc=$?
step build "$([ $build_rc = 0 ] && echo ok || echo "FAILED (see build.log)")"
if [ $build_rc != 0 ]; then tail -40 "$OUT/build.log"; cat "$OUT/summary.txt"; exit 1; fi

(cd build-gpu && ctest --output-on-failure -j4 --timeout 300) > "$OUT/ctest.log" 2>&1
step "ctest (all)" "$(grep -E 'tests passed|tests failed' "$OUT/ctest.log" | tail -1)"
(cd build-gpu && ctest -L gpu --output-on-failure --timeout 300 -V) > "$OUT/ctest-gpu.log" 2>&1
step "ctest -L gpu" "$(grep -E 'tests passed|tests failed' "$OUT/ctest-gpu.log" | tail -1)"
grep -E "Skipped|SKIPPED" "$OUT/ctest-gpu.log" | head -3 >> "$OUT/summary.txt"

if command -v compute-sanitizer >/dev/null; then
  san_fail=0
  for t in build-gpu/bin/gpu_*; do
    compute-sanitizer --tool memcheck --error-exitcode 9 "$t" --gtest_brief=1 > "$OUT/sanitizer-$(basename "$t").log" 2>&1 || san_fail=1
  done
  step compute-sanitizer "$([ $san_fail = 0 ] && echo clean || echo "ERRORS (see sanitizer-*.log)")"
fi

anchor=$(python3 bench/gpu_prefill_anchor.py 2>"$OUT/anchor.err" | awk '/prefill_ms/{print $2}')
step "torch causal prefill ms" "${anchor:-n/a} (131072 tok, 32 q / 8 kv heads, d=128, bf16)"
for b in build-gpu/bin/gpu_*bench*; do
  [ -x "$b" ] || continue
  "$b" > "$OUT/$(basename "$b").log" 2>&1
  step "$(basename "$b")" "rc=$? (see log)"
  tail -15 "$OUT/$(basename "$b").log"
done
cat "$OUT/summary.txt"

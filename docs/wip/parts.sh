#!/bin/bash
# The batch in parts side by side (bench/RESULTS.md, "2026-12-07, twelfth
# session"): the serving bench at 128K, batch 7 and 13, 8-bit pages, with
# WKV_SERVING_STREAMS=1 to 4, two rounds; the full-attention anchor is the
# figure of the call before it on the same kind of machine. Run on the GPU
# machine from the repository root (a device call carrying .debs).
export LD_LIBRARY_PATH=/tmp/wkv-debs/usr/lib/x86_64-linux-gnu
T0=$SECONDS
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
JOBS=16 BUILD_TARGETS="gpu_serving_bench" OUT=/tmp/cur tools/gpu-check.sh build > /tmp/b.txt 2>&1; echo "build rc=$? $((SECONDS-T0)) s"; grep -E "error" -A3 /tmp/b.txt | head
export WKV_FULL_ATTN_MS=4:0.7363,7:1.2367 WKV_FULL_BATCH_MAX=4 WKV_PAGE_FORMAT=1
for r in 1 2; do for b in 7 13; do for p in 1 2 3 4; do
  [ $((SECONDS-T0)) -lt 480 ] || break
  WKV_SERVING_STREAMS=$p timeout 100 build-gpu/bin/gpu_serving_bench 131072 $b > /tmp/x.txt 2>&1; echo "== parts=$p b=$b rc=$? $((SECONDS-T0)) s"; grep -E "^ +[0-9]+ +[0-9.]+ |rror" /tmp/x.txt
done; done; done

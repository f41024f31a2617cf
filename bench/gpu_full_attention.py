"""The anchor of bench/gpu_serving_bench.cu: full attention's decoding step of
one layer with PyTorch SDPA (32 q heads, 8 KV heads, d=128, bf16), the KV of
B sequences of T tokens on the GPU. A step is what a runtime does per layer:
write the new token's K and V into the cache, then attend over the prefix.
Every SDPA backend that accepts GQA is tried; the fastest is kept.

Prints, one per line:
  full_ms B ms backend      median per-layer step at batch B (CUDA events)
  full_batch_max N          the largest batch whose KV over 32 layers fits
                            the GPU's free memory (bf16, T tokens each)
  stream_ms ms              (with --stream, batch 1) the same step with the
                            layer's KV copied from pinned host memory first,
                            full attention when the KV does not fit the GPU
Usage: python3 gpu_full_attention.py [T] [batches, comma-separated] [--stream]"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

T = int(sys.argv[1]) if len(sys.argv) > 1 else 131072
BATCHES = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "1,2,4,7").split(",")]
STREAM = "--stream" in sys.argv
Q, H, D, LAYERS, STEPS = 32, 8, 128, 32, 40
dev = "cuda"
dt = torch.bfloat16

free, _ = torch.cuda.mem_get_info()
per_seq = LAYERS * T * H * D * 2 * 2
print(f"full_batch_max {int(free * 0.95 // per_seq)}", flush=True)


def timed(fn, n):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]

for B in BATCHES:
    k = torch.randn(B, H, T + 1, D, device=dev, dtype=dt)
    v = torch.randn(B, H, T + 1, D, device=dev, dtype=dt)
    q = torch.randn(B, Q, 1, D, device=dev, dtype=dt)
    nk = torch.randn(B, H, 1, D, device=dev, dtype=dt)
    nv = torch.randn(B, H, 1, D, device=dev, dtype=dt)

    def step():
        k[:, :, T:T + 1].copy_(nk)
        v[:, :, T:T + 1].copy_(nv)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    best = None
    for be in BACKENDS:
        try:
            with sdpa_kernel([be]):
                ms = timed(step, STEPS)
        except RuntimeError:
            continue
        if best is None or ms < best[0]:
            best = (ms, be.name)
    print(f"full_ms {B} {best[0]:.4f} {best[1]}", flush=True)
    del k, v, q, nk, nv
    torch.cuda.empty_cache()

if STREAM:
    hk = torch.randn(1, H, T, D, dtype=dt).pin_memory()
    hv = torch.randn(1, H, T, D, dtype=dt).pin_memory()
    k = torch.empty(1, H, T, D, device=dev, dtype=dt)
    v = torch.empty(1, H, T, D, device=dev, dtype=dt)
    q = torch.randn(1, Q, 1, D, device=dev, dtype=dt)

    def stream_step():
        k.copy_(hk, non_blocking=True)
        v.copy_(hv, non_blocking=True)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    print(f"stream_ms {timed(stream_step, 5):.3f}", flush=True)

"""Anchor for the index-build target: PyTorch's causal prefill attention of one
layer (T tokens, Q query heads, KV heads shared GQA-style, head_dim D, bf16),
median of timed runs with CUDA events. Prints one line: 'prefill_ms <value>'.
Usage: python3 gpu_prefill_anchor.py [T] [Q] [H] [D]"""
import sys

import torch
import torch.nn.functional as F

T = int(sys.argv[1]) if len(sys.argv) > 1 else 131072
Q = int(sys.argv[2]) if len(sys.argv) > 2 else 32
H = int(sys.argv[3]) if len(sys.argv) > 3 else 8
D = int(sys.argv[4]) if len(sys.argv) > 4 else 128
dev = "cuda"
q = torch.randn(1, Q, T, D, device=dev, dtype=torch.bfloat16)
k = torch.randn(1, H, T, D, device=dev, dtype=torch.bfloat16)
v = torch.randn(1, H, T, D, device=dev, dtype=torch.bfloat16)
kw = {"enable_gqa": True} if H != Q else {}
for _ in range(2):
    F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
torch.cuda.synchronize()
times = []
for _ in range(5):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
    b.record()
    torch.cuda.synchronize()
    times.append(a.elapsed_time(b))
times.sort()
print(f"prefill_ms {times[len(times) // 2]:.3f}")

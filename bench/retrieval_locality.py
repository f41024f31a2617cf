"""How much of a decoding step's retrieval the next step retrieves again, on
the real-attention tensors (../shared/data/real-attention: a real model's
keys, values and 64 consecutive queries). This is the reuse a device block
cache can have at best: a unit retrieved at step j is a hit at step j+1 only
if step j+1 retrieves it too.

A CPU engine at the default budget holds the first 8128 tokens of each layer
as the prompt; then, for each of the 64 queries, its token is appended and the
query looked up and assembled. The execution buffer's rows that are neither
sink nor window are the step's retrieved tokens; for each (layer, KV head) the
script prints the share of step j's retrieved tokens that step j-1 retrieved
too (median and quartiles over the 63 pairs), the same over 8 steps
(tokens retrieved at step j and at any of the 8 before it), and the hit
ratio of an LRU cache of tokens holding 5% of the layer's tokens, fed each
step's retrieval (the share of steps 1..63's retrieved tokens it held; the
serving bench's device cache is 5% of the KV).

Usage: python3 bench/retrieval_locality.py [path to real-attention]"""
import collections
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bindings" / "python"))
import wavekv  # noqa: E402

root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "shared" / "data" / "real-attention"
if not (root / "manifest.json").exists():
    print(f"skipped: no real-attention data at {root}")
    sys.exit(0)
T, H, Q, D, NQ = 8192, 2, 4, 128, 64
P = T - NQ  # prompt


def row_key(row: np.ndarray) -> bytes:
    return hashlib.blake2b(row.tobytes(), digest_size=12).digest()


def lru_hit_ratio(sets: list, capacity: int) -> float:
    """Hits over lookups of an LRU cache of `capacity` tokens fed the sets in
    order, the first set (a cold cache) left out."""
    cache: collections.OrderedDict = collections.OrderedDict()
    hits = lookups = 0
    for j, s in enumerate(sets):
        if j > 0:
            hits += sum(1 for x in s if x in cache)
            lookups += len(s)
        for x in s:
            cache[x] = True
            cache.move_to_end(x)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits / max(1, lookups)


print(f"{'layer':>5} {'kv head':>7} {'retrieved/step':>14} {'again next step: p25 / median / p75':>36} {'within 8 steps (median)':>24} {'LRU 5% hit':>11}")
lru_all = []
for layer in range(6):
    raw = np.fromfile(root / f"layer{layer}.f16", dtype="<f2")
    k = raw[: T * H * D].reshape(T, H, D)
    v = raw[T * H * D: 2 * T * H * D].reshape(T, H, D)
    q = raw[2 * T * H * D:].reshape(NQ, Q, D)
    eng = wavekv.Engine(n_layers=1, n_q_heads=Q, n_kv_heads=H, head_dim=D, dtype="f16", threads=2)
    seq = eng.sequence()
    plan = eng.plan()
    seq.append(0, k[:P], v[:P])
    seq.end_prompt(0)
    cfg = eng.config
    history = [[] for _ in range(H)]  # per KV head: sets of retrieved rows per step
    for j in range(NQ):
        t = P + j
        seq.append(0, k[t:t + 1], v[t:t + 1])
        plan.lookup(seq, 0, q[j:j + 1])
        plan.assemble()
        xb = plan.xbuf()
        xk = np.array(np.asarray(xb.k), copy=True)
        offs = np.array(np.asarray(xb.offsets), copy=True)
        for h in range(H):
            steady = {row_key(k[i, h]) for i in range(cfg.sink_tokens)}
            steady |= {row_key(k[i, h]) for i in range(max(0, t + 1 - cfg.window_tokens), t + 1)}
            rows = xk[offs[h]:offs[h + 1]]
            got = {row_key(r) for r in rows} - steady
            history[h].append(got)
        plan.update()
    for h in range(H):
        sets = history[h]
        next_share = [len(sets[j] & sets[j - 1]) / max(1, len(sets[j])) for j in range(1, NQ)]
        win_share = [len(sets[j] & set().union(*sets[max(0, j - 8):j])) / max(1, len(sets[j])) for j in range(1, NQ)]
        p25, med, p75 = np.percentile(next_share, [25, 50, 75])
        lru = lru_hit_ratio(sets, int(0.05 * T))
        lru_all.append(lru)
        print(f"{layer:>5} {h:>7} {np.median([len(s) for s in sets]):>14.0f} {p25:>11.2f} / {med:.2f} / {p75:.2f}"
              f"{' ':>12}{np.median(win_share):>10.2f} {lru:>11.2f}")
print(f"LRU cache of 5% of the tokens: hit ratio {np.mean(lru_all):.2f} (mean over layers and KV heads)")

#!/usr/bin/env python3
"""A Hugging Face transformers Llama model decoding through wavekv.

wavekv is plugged in through transformers' attention-function registry
(AttentionInterface): the prefill runs the model's own attention (sdpa) while
each layer's keys and values go into wavekv sequences, and every decoding
step appends the new token's K and V and lets wavekv attend (Plan.decode). No
KV cache is kept by transformers on that path (use_cache=False): wavekv is the
cache.

No weights can be downloaded here, so the model is a small randomly
initialised Llama (GQA, head_dim 128). The same model is run unmodified (sdpa
and its DynamicCache) as the reference. Printed:

- greedy tokens: the tokens wavekv's model generates on its own, compared with
  the reference's (at --retrieval 1.0 they are the same);
- teacher-forced: both models fed the reference's tokens, the agreement of
  their argmax at each step and the largest difference of their logits.

    python3 bindings/python/examples/llama_decode.py [--device cpu|cuda] [--retrieval 1.0]

It needs torch and transformers; libwavekv is found as the package finds it
(WAVEKV_LIBRARY, the tree's build, the system). With --device cuda the engine
is a CUDA engine (a build with CUDA) working on torch's current stream.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, List, Optional, Tuple

try:
    import wavekv
except ImportError:  # running from a checkout without installing the package
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import wavekv

import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


class WavekvAttention:
    """An attention function for transformers' registry backed by wavekv.

    transformers calls it once per layer with query [B, Hq, T, D] and the
    layer's new key and value [B, Hkv, T, D] (post-RoPE; with use_cache=False
    only the tokens of this forward pass). T > 1 is the prefill: the K and V go
    into wavekv, the prompt is ended, and the model's own sdpa attends. T == 1
    is a decoding step: append the token, then wavekv attends.
    """

    def __init__(self, engine: wavekv.Engine) -> None:
        self.engine = engine
        self.plan = engine.plan()
        self.seqs: List[wavekv.Sequence] = []
        self.sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def start(self, batch: int) -> None:
        """New sequences for a new batch of prompts."""
        self.close_sequences()
        self.seqs = [self.engine.sequence() for _ in range(batch)]

    def close_sequences(self) -> None:
        for seq in self.seqs:
            seq.close()
        self.seqs = []

    def close(self) -> None:
        self.close_sequences()
        self.plan.close()

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                 scaling: Optional[float] = None, dropout: float = 0.0,
                 **kwargs: Any) -> Tuple[torch.Tensor, None]:
        layer = module.layer_idx
        batch, _, n_tokens, head_dim = query.shape
        if len(self.seqs) != batch:
            raise RuntimeError("WavekvAttention: start(%d) was not called" % batch)
        if scaling is not None and abs(scaling * head_dim ** 0.5 - 1.0) > 1e-6:
            raise ValueError("wavekv scales scores by 1/sqrt(head_dim); the model uses %g" % scaling)
        # [Hkv, T, D] -> [T, Hkv, D]: a view with other strides, not a copy.
        for b, seq in enumerate(self.seqs):
            seq.append(layer, key[b].transpose(0, 1), value[b].transpose(0, 1))
        if n_tokens > 1:
            for seq in self.seqs:
                seq.end_prompt(layer)
            return self.sdpa(module, query, key, value, attention_mask,
                             dropout=dropout, scaling=scaling, **kwargs)
        out = self.plan.decode(self.seqs, layer, query[:, :, 0, :])  # [B, Hq, D]
        return out.unsqueeze(1), None  # [B, T=1, Hq, D], as sdpa returns it


def make_model(args: argparse.Namespace, device: torch.device) -> LlamaForCausalLM:
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.q_heads,
        num_key_value_heads=args.kv_heads,
        head_dim=128,
        max_position_embeddings=args.prompt_len + args.steps + 16,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    return model.to(device=device, dtype=TORCH_DTYPES[args.dtype]).eval()


def set_attention(model: LlamaForCausalLM, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


@torch.no_grad()
def run_reference(model: LlamaForCausalLM, prompt: torch.Tensor, steps: int
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding with the unmodified model: (tokens [B, steps], logits
    [B, steps, vocab]); logits[:, i] are those that chose tokens[:, i]."""
    set_attention(model, "sdpa")
    out = model(prompt, use_cache=True)
    cache = out.past_key_values
    logits = [out.logits[:, -1].float()]
    tokens = [logits[-1].argmax(-1)]
    for _ in range(steps - 1):
        out = model(tokens[-1][:, None], past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1].float())
        tokens.append(logits[-1].argmax(-1))
    return torch.stack(tokens, 1), torch.stack(logits, 1)


@torch.no_grad()
def run_wavekv(model: LlamaForCausalLM, attn: WavekvAttention, prompt: torch.Tensor, steps: int,
               forced: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding through wavekv; with `forced`, those tokens are fed
    instead of the model's own (teacher forcing)."""
    set_attention(model, "wavekv")
    batch, n = prompt.shape
    attn.start(batch)
    out = model(prompt, use_cache=False)
    logits = [out.logits[:, -1].float()]
    tokens = [logits[-1].argmax(-1)]
    for i in range(steps - 1):
        feed = tokens[-1] if forced is None else forced[:, i]
        position = torch.full((batch, 1), n + i, dtype=torch.long, device=prompt.device)
        out = model(feed[:, None], position_ids=position, use_cache=False)
        logits.append(out.logits[:, -1].float())
        tokens.append(logits[-1].argmax(-1))
    attn.close_sequences()
    return torch.stack(tokens, 1), torch.stack(logits, 1)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--retrieval", type=float, default=None,
                   help="fraction of clusters attended exactly (default: the library's, 0.018); "
                        "1.0 attends every token exactly")
    p.add_argument("--estimation", type=float, default=None,
                   help="fraction of clusters estimated (default: the library's, 0.232; "
                        "0 when --retrieval is 1.0)")
    p.add_argument("--dtype", choices=tuple(TORCH_DTYPES), default="f32")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=32, help="tokens generated per sequence")
    p.add_argument("--batch", type=int, default=2, help="sequences decoded together")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--q-heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--require-identical", action="store_true",
                   help="exit 1 unless the greedy tokens are the reference's")
    args = p.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        print("llama_decode: --device cuda but torch sees no GPU", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    model = make_model(args, device)
    gen = torch.Generator().manual_seed(args.seed + 1)
    prompt = torch.randint(0, args.vocab, (args.batch, args.prompt_len), generator=gen).to(device)

    fields: dict = {}
    if args.retrieval is not None:
        fields["retrieval_frac"] = args.retrieval
        if args.estimation is None:
            fields["estimation_frac"] = min(0.232, max(0.0, 1.0 - args.retrieval))
    if args.estimation is not None:
        fields["estimation_frac"] = args.estimation
    engine = wavekv.Engine(
        n_layers=args.layers, n_q_heads=args.q_heads, n_kv_heads=args.kv_heads, head_dim=128,
        dtype=args.dtype, device=args.device, **fields)
    attn = WavekvAttention(engine)
    AttentionInterface.register("wavekv", attn)
    try:
        t0 = time.perf_counter()
        ref_tokens, ref_logits = run_reference(model, prompt, args.steps)
        t1 = time.perf_counter()
        wkv_tokens, _ = run_wavekv(model, attn, prompt, args.steps)
        t2 = time.perf_counter()
        forced_tokens, forced_logits = run_wavekv(model, attn, prompt, args.steps, forced=ref_tokens)
        stats = engine.stats()
        cfg = engine.config
    finally:
        attn.close()
        engine.close()

    total = ref_tokens.numel()
    same = int((wkv_tokens == ref_tokens).sum())
    prefix = [int(((wkv_tokens[b] != ref_tokens[b]).nonzero().flatten()[:1].tolist() or [args.steps])[0])
              for b in range(args.batch)]
    forced_same = int((forced_tokens == ref_tokens).sum())
    diff = (forced_logits - ref_logits).abs().max().item()
    scale = ref_logits.abs().max().item()
    identical = same == total
    print("llama_decode: %s engine, %s, %d layers, %d q heads / %d kv heads, head_dim 128, "
          "batch %d, prompt %d tokens, %d steps"
          % (engine.device, args.dtype, args.layers, args.q_heads, args.kv_heads, args.batch,
             args.prompt_len, args.steps))
    attended = ""
    if stats.attended_tokens:  # counted by the CPU backend
        attended = "; %.0f tokens attended exactly per (sequence, layer, kv head) on average" % (
            stats.attended_tokens / max(1, stats.lookups * args.kv_heads))
    print("  retrieval_frac %.3g, estimation_frac %.3g%s"
          % (cfg.retrieval_frac, cfg.estimation_frac, attended))
    print("  greedy tokens: %d/%d agree with the unmodified model (%s); identical prefix per "
          "sequence: %s" % (same, total, "identical" if identical else "different", prefix))
    print("  teacher-forced: argmax agrees at %d/%d steps; max |logit diff| %.3g (logits up to %.3g)"
          % (forced_same, total, diff, scale))
    print("  time: reference %.2f s, wavekv %.2f s" % (t1 - t0, t2 - t1))
    if args.require_identical and not identical:
        print("llama_decode: FAILED: the greedy tokens differ from the unmodified model's",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

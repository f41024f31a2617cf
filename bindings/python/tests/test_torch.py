"""PyTorch tensors on the CPU (skipped visibly where torch is not installed)."""

from __future__ import annotations

import sys
from typing import Any

import pytest

import wavekv
from conftest import small_engine

torch = pytest.importorskip("torch")
F = torch.nn.functional

HQ, HKV, D = 8, 2, 128
DTYPES = {"f32": (torch.float32, 2e-5), "f16": (torch.float16, 2e-3), "bf16": (torch.bfloat16, 2e-2)}


def sdpa_reference(q: Any, k: Any, v: Any) -> Any:
    """torch's scaled_dot_product_attention in float32. q [n][HQ][D];
    k, v [n][T][HKV][D] -> [n][HQ][D]."""
    qf = q.float()[:, :, None, :]                                    # [n, HQ, 1, D]
    kf = k.float().transpose(1, 2).repeat_interleave(HQ // HKV, 1)   # [n, HQ, T, D]
    vf = v.float().transpose(1, 2).repeat_interleave(HQ // HKV, 1)
    return F.scaled_dot_product_attention(qf, kf, vf)[:, :, 0, :]


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_decode_matches_sdpa(dtype: str) -> None:
    tdtype, atol = DTYPES[dtype]
    gen = torch.Generator().manual_seed(0)
    n, prompt, steps = 2, 700, 4
    k = torch.randn(n, prompt + steps, HKV, D, generator=gen).to(tdtype)
    v = torch.randn(n, prompt + steps, HKV, D, generator=gen).to(tdtype)
    with small_engine(head_dim=D, dtype=dtype, retrieval_frac=1.0, estimation_frac=0.0) as eng, \
            eng.plan() as plan, eng.sequence() as s0, eng.sequence() as s1:
        seqs = [s0, s1]
        for i, seq in enumerate(seqs):
            for start in range(0, prompt, 256):
                end = min(prompt, start + 256)
                seq.append(1, k[i, start:end], v[i, start:end])
            seq.end_prompt(1)
        for t in range(prompt, prompt + steps):
            for i, seq in enumerate(seqs):
                seq.append(1, k[i, t:t + 1], v[i, t:t + 1])
            q = torch.randn(n, HQ, D, generator=gen).to(tdtype)
            out = plan.decode(seqs, 1, q)
            assert isinstance(out, torch.Tensor) and out.dtype == tdtype and out.shape == (n, HQ, D)
            want = sdpa_reference(q, k[:, :t + 1], v[:, :t + 1])
            torch.testing.assert_close(out.float(), want, atol=atol, rtol=atol)


def test_strided_views_and_grad() -> None:
    """[B, H, T, D] tensors as transformers holds them, viewed as [T, H, D]
    by transposing: read in place; tensors that require grad are detached."""
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(1, HKV, 300, D, generator=gen, requires_grad=True)
    v = torch.randn(1, HKV, 300, D, generator=gen)
    q = torch.randn(1, HQ, 1, D, generator=gen)
    with small_engine(head_dim=D, retrieval_frac=1.0, estimation_frac=0.0) as eng, \
            eng.plan() as plan, eng.sequence() as seq:
        seq.append(0, k[0].transpose(0, 1), v[0].transpose(0, 1))
        out = torch.zeros(1, HQ, D)
        result = plan.decode([seq], 0, q[:, :, 0, :], out=out)
        assert result is out
        want = sdpa_reference(q[:, :, 0, :], k.detach().transpose(1, 2), v.transpose(1, 2))
        torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def test_refused_tensors() -> None:
    with small_engine(head_dim=D) as eng, eng.sequence() as seq, eng.plan() as plan:
        good = torch.zeros(8, HKV, D)
        with pytest.raises(wavekv.InvalidArgumentError, match="dtype float16; expected float32"):
            seq.append(0, good.half(), good.half())
        with pytest.raises(wavekv.InvalidArgumentError, match="contiguous"):
            wide = torch.zeros(8, HKV, 2 * D)
            seq.append(0, wide[..., ::2], wide[..., ::2])
        with pytest.raises(wavekv.InvalidArgumentError, match="shape"):
            seq.append(0, good.reshape(8, HKV * D), good.reshape(8, HKV * D))
        assert seq.info(0).tokens == 0
        seq.append(0, good, good)
        with pytest.raises(wavekv.InvalidArgumentError, match="dtype"):
            plan.decode([seq], 0, torch.zeros(1, HQ, D), out=torch.zeros(1, HQ, D, dtype=torch.float64))


def test_no_reference_leak() -> None:
    k = torch.zeros(4, HKV, D)
    before = sys.getrefcount(k)
    with small_engine(head_dim=D) as eng, eng.sequence() as seq:
        for _ in range(50):
            seq.append(0, k, k)
    assert sys.getrefcount(k) == before


def test_cuda_tensor_on_a_cpu_engine() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    with small_engine(head_dim=D) as eng, eng.sequence() as seq:
        k = torch.zeros(4, HKV, D, device="cuda")
        with pytest.raises(wavekv.InvalidArgumentError, match="on cuda:0; this engine takes tensors on cpu"):
            seq.append(0, k, k)

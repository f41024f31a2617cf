"""A CUDA engine fed CUDA tensors (skipped visibly without torch, a GPU, or a
libwavekv built with CUDA)."""

from __future__ import annotations

from typing import Any

import pytest

import wavekv

torch = pytest.importorskip("torch")
F = torch.nn.functional

if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA device", allow_module_level=True)

HQ, HKV, D = 8, 2, 128


def cuda_engine(**fields: Any) -> wavekv.Engine:
    base = dict(n_layers=2, n_q_heads=HQ, n_kv_heads=HKV, head_dim=D, device="cuda",
                device_id=torch.cuda.current_device(), retrieval_frac=1.0, estimation_frac=0.0)
    base.update(fields)
    try:
        return wavekv.Engine(**base)
    except (wavekv.UnsupportedError, wavekv.NoDeviceError) as exc:
        pytest.skip("libwavekv cannot open a CUDA engine here: %s" % exc)
        raise


def sdpa(q: Any, k: Any, v: Any) -> Any:
    """torch's scaled_dot_product_attention. q [n][HQ][D]; k, v [n][T][HKV][D]."""
    kk = k.transpose(1, 2).repeat_interleave(HQ // HKV, 1)
    vv = v.transpose(1, 2).repeat_interleave(HQ // HKV, 1)
    return F.scaled_dot_product_attention(q[:, :, None, :], kk, vv)[:, :, 0, :]


@pytest.mark.parametrize("dtype,tdtype,atol", [("f16", torch.float16, 3e-3),
                                               ("bf16", torch.bfloat16, 2e-2),
                                               ("f32", torch.float32, 1e-4)])
def test_decode_matches_sdpa_on_a_side_stream(dtype: str, tdtype: Any, atol: float) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, prompt, steps = 2, 3000, 6
    stream = torch.cuda.Stream()
    with cuda_engine(dtype=dtype) as eng, eng.plan() as plan, \
            eng.sequence() as s0, eng.sequence() as s1, torch.cuda.stream(stream):
        assert eng.device == "cuda"
        seqs = [s0, s1]
        # [n, HKV, T, D] as a model holds them; appended as [T, HKV, D] views
        k = torch.randn(n, HKV, prompt + steps, D, device="cuda", generator=gen, dtype=tdtype)
        v = torch.randn(n, HKV, prompt + steps, D, device="cuda", generator=gen, dtype=tdtype)
        for i, seq in enumerate(seqs):
            for start in range(0, prompt, 1024):
                end = min(prompt, start + 1024)
                seq.append(0, k[i, :, start:end].transpose(0, 1), v[i, :, start:end].transpose(0, 1))
            seq.end_prompt(0)
        for t in range(prompt, prompt + steps):
            for i, seq in enumerate(seqs):
                seq.append(0, k[i, :, t:t + 1].transpose(0, 1), v[i, :, t:t + 1].transpose(0, 1))
            q = torch.randn(n, HQ, D, device="cuda", generator=gen, dtype=tdtype)
            out = plan.decode(seqs, 0, q)  # on torch's current stream: the side stream
            assert out.is_cuda and out.dtype == tdtype and out.shape == (n, HQ, D)
            want = sdpa(q, k[:, :, :t + 1].transpose(1, 2), v[:, :, :t + 1].transpose(1, 2))
            torch.testing.assert_close(out.float(), want.float(), atol=atol, rtol=atol)
        stats = eng.stats()
        assert stats.device == "cuda" and stats.lookups == n * steps
    stream.synchronize()


def test_explicit_stream_and_out() -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    stream = torch.cuda.Stream()
    with cuda_engine(dtype="f16") as eng, eng.plan() as plan, eng.sequence() as seq:
        k = torch.randn(500, HKV, D, device="cuda", generator=gen, dtype=torch.float16)
        v = torch.randn(500, HKV, D, device="cuda", generator=gen, dtype=torch.float16)
        q = torch.randn(1, HQ, D, device="cuda", generator=gen, dtype=torch.float16)
        stream.wait_stream(torch.cuda.current_stream())
        seq.append(1, k, v, stream=stream)
        out = torch.empty(1, HQ, D, device="cuda", dtype=torch.float16)
        plan.decode([seq], 1, q, out=out, stream=stream.cuda_stream)
        stream.synchronize()
        torch.testing.assert_close(out.float(), sdpa(q, k[None], v[None]).float(), atol=3e-3, rtol=3e-3)


def test_wrong_device_is_refused() -> None:
    with cuda_engine(dtype="f16") as eng, eng.sequence() as seq, eng.plan() as plan:
        host = torch.zeros(4, HKV, D, dtype=torch.float16)
        with pytest.raises(wavekv.InvalidArgumentError, match="on cpu; this engine takes tensors on cuda"):
            seq.append(0, host, host)
        assert seq.info(0).tokens == 0
        dev = host.cuda()
        seq.append(0, dev, dev)
        with pytest.raises(wavekv.InvalidArgumentError, match="out is on cpu"):
            plan.decode([seq], 0, torch.zeros(1, HQ, D, dtype=torch.float16, device="cuda"),
                        out=torch.zeros(1, HQ, D, dtype=torch.float16))


def test_xbuf_on_the_device() -> None:
    with cuda_engine(dtype="f16") as eng, eng.sequence() as seq, eng.plan() as plan:
        k = torch.randn(300, HKV, D, device="cuda", dtype=torch.float16)
        seq.append(0, k, k)
        plan.lookup([seq], 0, torch.randn(1, HQ, D, device="cuda", dtype=torch.float16))
        plan.assemble()
        x = plan.xbuf()
        offsets = torch.as_tensor(x.offsets, device="cuda")
        keys = torch.as_tensor(x.k, device="cuda")
        torch.cuda.synchronize()
        assert offsets.shape == (x.n_runs + 1,) and x.n_runs == HKV
        assert int(offsets[-1]) == HKV * 300 <= x.n_tokens  # full retrieval: every token
        assert keys.shape == (x.n_tokens, D) and keys.dtype == torch.float16
        # run 0 holds KV head 0's keys, in some order
        run0 = keys[int(offsets[0]):int(offsets[1])].float()
        torch.testing.assert_close(run0.sum(0), k[:, 0].float().sum(0), atol=1e-2, rtol=1e-3)


def test_cupy_arrays() -> None:
    cupy = pytest.importorskip("cupy")
    with cuda_engine(dtype="f32") as eng, eng.sequence() as seq, eng.plan() as plan:
        k = cupy.random.standard_normal((400, HKV, D), dtype=cupy.float32)
        v = cupy.random.standard_normal((400, HKV, D), dtype=cupy.float32)
        q = cupy.random.standard_normal((1, HQ, D), dtype=cupy.float32)
        seq.append(0, k, v)
        out = plan.decode([seq], 0, q)
        assert isinstance(out, cupy.ndarray)
        want = sdpa(torch.as_tensor(q, device="cuda"), torch.as_tensor(k, device="cuda")[None],
                    torch.as_tensor(v, device="cuda")[None])
        torch.testing.assert_close(torch.as_tensor(out, device="cuda"), want, atol=1e-4, rtol=1e-4)


def test_append_batch_matches_one_append_per_sequence() -> None:
    """Sequence.append_batch of torch CUDA tensors (one kernel writes every
    sequence's rows, on torch's current stream, a side stream here) decodes
    as one Sequence.append per sequence, and as sdpa: one token a step from
    a strided [n][1][HKV][D] view of the model's K, then three tokens from a
    buffer interleaved by token."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    n, prompt, steps = 3, 1200, 20
    total = prompt + steps + 3
    stream = torch.cuda.Stream()
    with cuda_engine(dtype="f16") as eb, cuda_engine(dtype="f16") as es, \
            eb.plan() as pb, es.plan() as ps, torch.cuda.stream(stream):
        batch = [eb.sequence() for _ in range(n)]
        single = [es.sequence() for _ in range(n)]
        k = torch.randn(n, total, HKV, D, device="cuda", generator=gen, dtype=torch.float16)
        v = torch.randn(n, total, HKV, D, device="cuda", generator=gen, dtype=torch.float16)
        for i in range(n):
            for seq in (batch[i], single[i]):
                seq.append(0, k[i, :prompt], v[i, :prompt])
                seq.end_prompt(0)

        def step(t: int) -> None:
            q = torch.randn(n, HQ, D, device="cuda", generator=gen, dtype=torch.float16)
            got, want = pb.decode(batch, 0, q), ps.decode(single, 0, q)
            assert torch.equal(got, want), "after %d tokens" % t
            torch.testing.assert_close(got.float(), sdpa(q, k[:, :t], v[:, :t]).float(),
                                       atol=3e-3, rtol=3e-3)

        for t in range(prompt, prompt + steps):
            wavekv.Sequence.append_batch(batch, 0, k[:, t:t + 1], v[:, t:t + 1])
            for i, seq in enumerate(single):
                seq.append(0, k[i, t:t + 1], v[i, t:t + 1])
            step(t + 1)
        t = prompt + steps
        kb = k[:, t:t + 3].transpose(0, 1).contiguous()  # [3][n][HKV][D]
        vb = v[:, t:t + 3].transpose(0, 1).contiguous()
        wavekv.Sequence.append_batch(batch, 0, kb.transpose(0, 1), vb.transpose(0, 1))
        for i, seq in enumerate(single):
            seq.append(0, k[i, t:t + 3], v[i, t:t + 3])
        step(t + 3)
        for i in range(n):
            assert batch[i].info(0) == single[i].info(0)
            assert batch[i].info(0).tokens == total
        with pytest.raises(wavekv.InvalidArgumentError, match="listed twice"):
            wavekv.Sequence.append_batch([batch[0], batch[0]], 0, k[:2, :1], v[:2, :1])
        with pytest.raises(wavekv.InvalidArgumentError, match="on cpu; this engine takes tensors on cuda"):
            host = k[:, :1].cpu()
            wavekv.Sequence.append_batch(batch, 0, host, host)
        for seq in batch + single:
            seq.close()
    stream.synchronize()


def test_meta_rows_in_host_memory_decode_the_same_bits() -> None:
    """flags=WKV_CONFIG_HOST_META_ROWS (8, libwavekv 0.12): the meta index's
    f32 rows in pinned host memory. A CUDA engine with it decodes the same
    bits as one without, at the default budget and across growths of update
    segments (skipped where the device has no host memory pools)."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    prompt, steps = 4000, 120  # growths of 16 tokens once the window's 64 are passed
    fields = dict(dtype="f16", retrieval_frac=0.018, estimation_frac=0.232, update_segment_tokens=16)
    with cuda_engine(flags=8, **fields) as host, cuda_engine(**fields) as dev, dev.plan() as pd, host.plan() as ph, \
            dev.sequence() as sd, host.sequence() as sh:
        k = torch.randn(prompt + steps, HKV, D, device="cuda", generator=gen, dtype=torch.float16)
        v = torch.randn(prompt + steps, HKV, D, device="cuda", generator=gen, dtype=torch.float16)
        for seq in (sd, sh):
            seq.append(0, k[:prompt], v[:prompt])
            seq.end_prompt(0)
        segments0 = sh.info(0).segments
        for t in range(prompt, prompt + steps):
            for seq in (sd, sh):
                seq.append(0, k[t:t + 1], v[t:t + 1])
            q = torch.randn(1, HQ, D, device="cuda", generator=gen, dtype=torch.float16)
            assert torch.equal(ph.decode([sh], 0, q), pd.decode([sd], 0, q)), "after %d tokens" % (t + 1)
        assert sh.info(0) == sd.info(0)
        assert sh.info(0).segments >= segments0 + 2, "growths of update segments crossed"
        # libwavekv 0.13's stats say where the rows went: 1 KiB a cluster
        # (d = 128, f32 centroid and value sum) less on the device.
        st_h, st_d = host.stats(), dev.stats()
        assert st_h.clusters == st_d.clusters and st_h.meta_bytes == st_d.meta_bytes
        assert st_d.meta_device_bytes - st_h.meta_device_bytes == st_h.clusters * 2 * D * 4
        assert st_h.meta_host_rows_reserved >= st_h.clusters * 2 * D * 4 and st_d.meta_host_rows_reserved == 0
        for st in (st_h, st_d):
            assert st.device_bytes_reserved >= st.device_bytes_used >= st.device_cache_bytes + st.meta_device_bytes

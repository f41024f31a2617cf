"""Sequence.append_batch (wkv_append_batch, ABI 0.5): one call appends to a
layer of several sequences. Appending each step's tokens to three sequences
in one call decodes bit for bit as appending them to each with
Sequence.append; bad batches raise the binding's exception classes with the
library's message (or the binding's, where it refuses first) and append
nothing."""

from __future__ import annotations

from typing import Any, List, Tuple

import pytest

import wavekv
from conftest import small_engine

LAYERS, HQ, HKV, D = 2, 8, 2, 64
N = 3


def engine_pair() -> Tuple[wavekv.Engine, wavekv.Engine]:
    fields = dict(n_layers=LAYERS, n_q_heads=HQ, n_kv_heads=HKV, head_dim=D,
                  segment_tokens=512, update_segment_tokens=128)
    return small_engine(**fields), small_engine(**fields)


def prefill(seq: wavekv.Sequence, k: Any, v: Any) -> None:
    for layer in range(LAYERS):
        for start in range(0, len(k[layer]), 700):
            seq.append(layer, k[layer][start:start + 700], v[layer][start:start + 700])
        seq.end_prompt(layer)


def test_batch_appends_decode_as_one_append_per_sequence(np: Any) -> None:
    """One token a step, three every 50th (speculative decoding); layer 0
    takes packed [n_seqs][n_tokens][HKV][D] tensors (k3[:, None] for the
    decoding layout [n_seqs][HKV][D]), layer 1 views of a buffer interleaved
    by token with padded heads (the padding NaN: never read). 320 generated
    tokens: segments complete and are clustered under both."""
    rng = np.random.default_rng(11)
    centres = rng.standard_normal((16, HKV, D))

    def kv(shape: Tuple[int, ...]) -> Tuple[Any, Any]:
        pick = rng.integers(0, len(centres), size=shape + (HKV,))
        k = centres[pick, np.arange(HKV)] + 0.3 * rng.standard_normal(shape + (HKV, D))
        return k.astype(np.float32), rng.standard_normal(shape + (HKV, D)).astype(np.float32)

    batch_eng, single_eng = engine_pair()
    with batch_eng, single_eng:
        batch = [batch_eng.sequence() for _ in range(N)]
        single = [single_eng.sequence() for _ in range(N)]
        batch_plan, single_plan = batch_eng.plan(), single_eng.plan()
        for i, length in enumerate((1500, 900, 2100)):
            ks, vs = zip(*(kv((length,)) for _ in range(LAYERS)))
            prefill(batch[i], ks, vs)
            prefill(single[i], ks, vs)
        prompt_clustered = [s.info(0).clustered for s in single]
        compared = generated = 0
        steps = 280
        for step in range(steps):
            n_tok = 3 if step % 50 == 49 else 1
            generated += n_tok
            for layer in range(LAYERS):
                k, v = kv((N, n_tok))  # [N][n_tok][HKV][D]
                if layer == 0 and n_tok == 1:
                    k3, v3 = k[:, 0].copy(), v[:, 0].copy()  # [N][HKV][D]
                    wavekv.Sequence.append_batch(batch, layer, k3[:, None], v3[:, None])
                elif layer == 0:
                    wavekv.Sequence.append_batch(batch, layer, k, v)
                else:
                    kb = np.full((n_tok, N, HKV, D + 8), np.nan, dtype=np.float32)
                    vb = kb.copy()
                    kb[..., :D] = k.transpose(1, 0, 2, 3)
                    vb[..., :D] = v.transpose(1, 0, 2, 3)
                    kview = kb[..., :D].transpose(1, 0, 2, 3)  # [N][n_tok][HKV][D], strided
                    vview = vb[..., :D].transpose(1, 0, 2, 3)
                    assert not kview.flags.c_contiguous
                    wavekv.Sequence.append_batch(batch, layer, kview, vview)
                for i, s in enumerate(single):
                    s.append(layer, k[i], v[i])
                if step % 25 == 24 or step + 1 == steps:
                    q = rng.standard_normal((N, HQ, D)).astype(np.float32)
                    got = batch_plan.decode(batch, layer, q)
                    want = single_plan.decode(single, layer, q)
                    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), \
                        "step %d, layer %d" % (step, layer)
                    compared += 1
        assert compared == LAYERS * (steps // 25 + 1)
        for i in range(N):
            for layer in range(LAYERS):
                assert batch[i].info(layer) == single[i].info(layer), (i, layer)
            assert batch[i].info(0).tokens == single[i].info(0).tokens
            assert batch[i].info(0).clustered > prompt_clustered[i], "no segment completed"
        bs, ss = batch_eng.stats(), single_eng.stats()
        assert (bs.tokens, bs.segments, bs.clusters) == (ss.tokens, ss.segments, ss.clusters)
        for obj in batch + single + [batch_plan, single_plan]:
            obj.close()


def kv_of(np: Any, n_seqs: int, n_tokens: int = 1) -> Any:
    return np.full((n_seqs, n_tokens, HKV, D), 0.5, dtype=np.float32)


def assert_nothing_appended(seqs: List[wavekv.Sequence]) -> None:
    for s in seqs:
        assert s.info(0).tokens == 0, "a refused batch appended"


def test_a_sequence_listed_twice(np: Any) -> None:
    with small_engine() as eng, eng.sequence() as a, eng.sequence() as b:
        k = kv_of(np, 3)
        with pytest.raises(wavekv.InvalidArgumentError) as info:
            wavekv.Sequence.append_batch([a, b, a], 0, k, k)
        assert info.value.status == 1
        assert info.value.message == "wkv_append_batch: a sequence is listed twice"
        assert_nothing_appended([a, b])
        # Each sequence was entered once and left again.
        wavekv.Sequence.append_batch([a, b], 0, k[:2], k[:2])
        assert (a.info(0).tokens, b.info(0).tokens) == (1, 1)


def test_sequences_of_two_engines(np: Any) -> None:
    with small_engine() as e1, small_engine() as e2, e1.sequence() as a, e2.sequence() as x:
        k = kv_of(np, 2)
        with pytest.raises(wavekv.InvalidHandleError) as info:
            wavekv.Sequence.append_batch([a, x], 0, k, k)
        assert info.value.status == 2
        assert info.value.message.startswith(
            "wkv_append_batch: sequence 1 belongs to another engine"), info.value.message
        assert_nothing_appended([a, x])


def test_a_destroyed_sequence(np: Any) -> None:
    with small_engine() as eng, eng.sequence() as a:
        k = kv_of(np, 2)
        # Closed through the binding: refused before the call, as in Plan.decode.
        dead = eng.sequence()
        dead.close()
        with pytest.raises(wavekv.InvalidHandleError, match="sequence is closed") as info:
            wavekv.Sequence.append_batch([a, dead], 0, k, k)
        assert info.value.status == 2
        assert_nothing_appended([a])
        # Destroyed under the binding (through the C ABI itself): the
        # library's message.
        gone = eng.sequence()
        wavekv._lib.lib().wkv_seq_destroy(gone._handle)
        with pytest.raises(wavekv.InvalidHandleError) as info:
            wavekv.Sequence.append_batch([a, gone], 0, k, k)
        assert info.value.message.startswith(
            "wkv_append_batch: not a live wkv_seq handle"), info.value.message
        gone.close()  # the stale handle: a no-op in the library
        assert_nothing_appended([a])


@pytest.mark.parametrize("shape", [(2, HKV, D), (3, 1, HKV, D), (2, 1, HKV + 1, D), (2, 1, HKV, D // 2),
                                   (2, 0, HKV, D), (1, 2, 1, HKV, D)])
def test_wrong_shape(np: Any, shape: Tuple[int, ...]) -> None:
    with small_engine() as eng, eng.sequence() as a, eng.sequence() as b:
        bad = np.zeros(shape, dtype=np.float32)
        with pytest.raises(wavekv.InvalidArgumentError, match="shape") as info:
            wavekv.Sequence.append_batch([a, b], 0, bad, bad)
        assert info.value.status == 1
        assert info.value.message.startswith("Sequence.append_batch: k has shape")
        assert "(n_seqs, n_tokens, n_kv_heads, head_dim)" in info.value.message
        assert_nothing_appended([a, b])


def test_other_refusals(np: Any) -> None:
    with small_engine() as eng, eng.sequence() as a, eng.sequence() as b:
        ab = [a, b]
        k = kv_of(np, 2, 2)
        padded = np.zeros((2, 2, HKV, D + 8), dtype=np.float32)[..., :D]
        gapped = np.zeros((2, 2, HKV, 2 * D), dtype=np.float32)[..., ::2]
        cases = [
            (lambda: wavekv.Sequence.append_batch(ab, 0, k, k[:, :1]), wavekv.InvalidArgumentError,
             "Sequence.append_batch: k has 2 tokens and v 1"),
            (lambda: wavekv.Sequence.append_batch(ab, 0, k, padded), wavekv.InvalidArgumentError,
             "the same strides"),
            (lambda: wavekv.Sequence.append_batch(ab, 0, k.astype(np.float16), k.astype(np.float16)),
             wavekv.InvalidArgumentError, "dtype float16"),
            (lambda: wavekv.Sequence.append_batch([], 0, k, k), wavekv.InvalidArgumentError,
             "no sequences"),
            (lambda: wavekv.Sequence.append_batch([a, "b"], 0, k, k), wavekv.InvalidArgumentError,
             "wavekv.Sequence"),
            (lambda: wavekv.Sequence.append_batch(ab, 0, np.broadcast_to(k[:1], k.shape),
                                                  np.broadcast_to(k[:1], k.shape)),
             wavekv.InvalidArgumentError, "broadcast"),
            (lambda: wavekv.Sequence.append_batch(ab, 0, k[:, ::-1], k[:, ::-1]),
             wavekv.InvalidArgumentError, "negative strides"),
            (lambda: wavekv.Sequence.append_batch(ab, 0, gapped, gapped),
             wavekv.InvalidArgumentError, "must be contiguous"),
            # The library's: a layer past the engine's.
            (lambda: wavekv.Sequence.append_batch(ab, LAYERS, k, k), wavekv.OutOfRangeError,
             "wkv_append_batch: "),
        ]
        for call, cls, words in cases:
            with pytest.raises(cls) as info:
                call()
            assert words in info.value.message, (words, info.value.message)
        assert_nothing_appended(ab)
        # One sequence alone, or a Sequence instead of a list: a batch of one.
        wavekv.Sequence.append_batch(a, 0, k[:1], k[:1])
        assert a.info(0).tokens == 2


def test_sequences_apart_by_any_stride(np: Any, exact: Any) -> None:
    """Sequences interleaved by token, and a batch of sequences that share
    rows (k is only read): each gets its own rows."""
    with small_engine(retrieval_frac=1.0, estimation_frac=0.0) as eng, eng.plan() as plan:
        seqs = [eng.sequence() for _ in range(3)]
        rng = np.random.default_rng(3)
        k = rng.standard_normal((40, 3, HKV, D)).astype(np.float32)  # [tokens][seqs][HKV][D]
        v = rng.standard_normal((40, 3, HKV, D)).astype(np.float32)
        wavekv.Sequence.append_batch(seqs, 0, k.transpose(1, 0, 2, 3), v.transpose(1, 0, 2, 3))
        # Rows shared: sequence i reads tokens i .. i + 9 of one buffer.
        shared = rng.standard_normal((12, HKV, D)).astype(np.float32)
        lib = np.lib.stride_tricks.as_strided(
            shared, shape=(3, 10, HKV, D), strides=(shared.strides[0],) + shared.strides)
        wavekv.Sequence.append_batch(seqs, 1, lib, lib)
        q = rng.standard_normal((3, HQ, D)).astype(np.float32)
        out0 = plan.decode(seqs, 0, q)
        out1 = plan.decode(seqs, 1, q)
        for i in range(3):
            np.testing.assert_allclose(out0[i], exact(q[i], k[:, i], v[:, i]), atol=2e-5)
            np.testing.assert_allclose(out1[i], exact(q[i], shared[i:i + 10], shared[i:i + 10]),
                                       atol=2e-5)
        for s in seqs:
            s.close()


def test_after_the_engine_closes(np: Any) -> None:
    eng = small_engine()
    a, b = eng.sequence(), eng.sequence()
    eng.close()
    k = kv_of(np, 2, 4)
    wavekv.Sequence.append_batch([a, b], 0, k, k)
    assert (a.info(0).tokens, b.info(0).tokens) == (4, 4)
    a.close()
    b.close()

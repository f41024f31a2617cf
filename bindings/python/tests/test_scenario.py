"""The scenario every binding runs: a CPU engine, two sequences, a synthetic
context appended in chunks, decoding steps for both compared with exact
attention computed here (NumPy, float64), the stats, a sequence saved to a
file and loaded back (decoding it bit for bit as the original, a corrupted
copy and an engine of another head_dim refused), and three errors."""

from __future__ import annotations

from typing import Any, List

import pytest

import wavekv
from wavekv import _lib

LAYERS, HQ, HKV, D = 2, 8, 2, 128
PROMPT, CHUNK, STEPS = 2500, 600, 6


class Context:
    """Keys drawn around a few centres per KV head, queries pointing at one of
    them: attention concentrates as in a trained model, so that the default
    budget (a few clusters attended exactly) is a fair approximation."""

    def __init__(self, np: Any, seed: int) -> None:
        self.np = np
        self.rng = np.random.default_rng(seed)
        self.centres = self.rng.standard_normal((128, HKV, D))

    def kv(self, n: int) -> Any:
        np, rng = self.np, self.rng
        pick = rng.integers(0, len(self.centres), size=(n, HKV))
        k = self.centres[pick, np.arange(HKV)] + 0.3 * rng.standard_normal((n, HKV, D))
        v = rng.standard_normal((n, HKV, D))
        return k.astype(np.float32), v.astype(np.float32)

    def q(self) -> Any:
        np, rng = self.np, self.rng
        target = self.centres[rng.integers(0, len(self.centres)), np.arange(HQ) // (HQ // HKV)]
        return (target + 0.3 * rng.standard_normal((HQ, D))).astype(np.float32)


def rel_err(np: Any, got: Any, want: Any) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("budget", ["full", "default"])
def test_two_sequences_chunked_prompt_and_decoding(np: Any, exact: Any, tmp_path: Any,
                                                   budget: str) -> None:
    fields = dict(retrieval_frac=1.0, estimation_frac=0.0) if budget == "full" else {}
    contexts = [Context(np, seed) for seed in (1, 2)]
    # history[s][layer] = (list of k chunks, list of v chunks)
    history: List[List[Any]] = [[([], []) for _ in range(LAYERS)] for _ in contexts]
    worst = 0.0
    with wavekv.Engine(n_layers=LAYERS, n_q_heads=HQ, n_kv_heads=HKV, head_dim=D, dtype="f32",
                       device="cpu", threads=2, **fields) as engine:
        assert engine.device == "cpu"
        with engine.sequence() as s0, engine.sequence() as s1, engine.plan() as plan:
            seqs = [s0, s1]
            # 1. the prompt, in chunks, then its end
            for layer in range(LAYERS):
                for s, seq in enumerate(seqs):
                    for start in range(0, PROMPT, CHUNK):
                        k, v = contexts[s].kv(min(CHUNK, PROMPT - start))
                        seq.append(layer, k, v)
                        history[s][layer][0].append(k)
                        history[s][layer][1].append(v)
                    seq.end_prompt(layer)
            # 2. decoding steps for both sequences at once
            for _ in range(STEPS):
                for layer in range(LAYERS):
                    for s, seq in enumerate(seqs):
                        k, v = contexts[s].kv(1)
                        seq.append(layer, k, v)
                        history[s][layer][0].append(k)
                        history[s][layer][1].append(v)
                    q = np.stack([c.q() for c in contexts])
                    out = plan.decode(seqs, layer, q)
                    for s in range(len(seqs)):
                        k_all = np.concatenate(history[s][layer][0])
                        v_all = np.concatenate(history[s][layer][1])
                        want = exact(q[s], k_all, v_all)
                        if budget == "full":
                            np.testing.assert_allclose(out[s], want, atol=1e-4, rtol=1e-4)
                        worst = max(worst, rel_err(np, out[s].astype(np.float64), want))
            # 3. what the engine and the sequences hold
            total = PROMPT + STEPS
            for seq in seqs:
                for layer in range(LAYERS):
                    info = seq.info(layer)
                    assert info.tokens == total and info.generating
                    assert info.sink + info.clustered + info.tail == total
                    assert info.clusters > 0 and info.pages > 0
            stats = engine.stats()
            assert stats.device == "cpu" and stats.sequences == 2
            assert stats.tokens == 2 * LAYERS * total
            assert stats.lookups == 2 * LAYERS * STEPS
            assert stats.clusters > 0 and stats.host_bytes_used > 0
            if budget == "full":
                assert stats.estimated_clusters == 0
                assert stats.attended_tokens >= stats.lookups * HKV * PROMPT
            else:
                assert stats.estimated_clusters > 0
                assert stats.attended_tokens < stats.lookups * HKV * PROMPT / 4
            js = engine.stats_json()
            assert js["config"]["n_layers"] == LAYERS and js["stats"]["tokens"] == stats.tokens
            # 4. the first sequence saved and loaded back
            save_and_load(np, engine, s0, plan, contexts[0], tmp_path)
    # the default budget attends a few clusters exactly and estimates others
    print("worst relative error at the %s budget: %.3g" % (budget, worst))
    assert worst < (1e-5 if budget == "full" else 0.05), worst


def save_and_load(np: Any, engine: Any, seq: Any, plan: Any, ctx: Context, tmp_path: Any) -> None:
    """Saves `seq` (after its decoding steps), loads it into the same engine
    and decodes one query on both at every layer: the outputs must be the
    same bits, since a loaded sequence holds the saved one's index and pages
    unchanged. Then a copy with one byte changed in its middle must be
    refused as corrupt, and the intact file by an engine of another
    head_dim."""
    path = tmp_path / "seq.wkv"
    seq.save(path, fsync=False)
    sequences = engine.stats().sequences
    with engine.load(path) as loaded:
        assert engine.stats().sequences == sequences + 1
        for layer in range(LAYERS):
            assert loaded.info(layer) == seq.info(layer)
            q = ctx.q()[None]
            a = plan.decode([seq], layer, q)
            b = plan.decode([loaded], layer, q)
            assert a.dtype == b.dtype == np.float32
            assert a.tobytes() == b.tobytes(), "layer %d: the loaded sequence differs" % layer
    # one byte changed in the middle of the file: refused, and nothing of it
    # is left in the engine (counted again here: the plan still refers to the
    # closed loaded sequence until its next lookup, which keeps it alive)
    sequences = engine.stats().sequences
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x5A
    corrupt = tmp_path / "corrupt.wkv"
    corrupt.write_bytes(bytes(data))
    with pytest.raises(wavekv.CorruptError) as damaged:
        engine.load(corrupt)
    assert damaged.value.status == 9 and damaged.value.status_name == "WKV_ERR_CORRUPT"
    assert "section" in damaged.value.message, damaged.value.message
    assert engine.stats().sequences == sequences
    # an engine of another shape: the message names the difference
    with wavekv.Engine(n_layers=LAYERS, n_q_heads=HQ, n_kv_heads=HKV, head_dim=D // 2,
                       dtype="f32", device="cpu", threads=2) as other:
        with pytest.raises(wavekv.InvalidArgumentError) as mismatch:
            other.load(path)
        assert mismatch.value.status == 1 and "head_dim" in mismatch.value.message
    # refused by the binding (a NUL would cut the path short in C) and by
    # the library (no such file)
    with pytest.raises(wavekv.InvalidArgumentError) as nul:
        engine.load(str(tmp_path / "seq\0.wkv"))
    assert "NUL" in nul.value.message
    with pytest.raises(wavekv.FileIOError):
        engine.load(tmp_path / "missing.wkv")


def test_save_and_reload_a_sequence(np: Any, tmp_path: Any) -> None:
    ctx = Context(np, 5)
    engine = wavekv.Engine(n_layers=LAYERS, n_q_heads=HQ, n_kv_heads=HKV, head_dim=D, dtype="f32",
                           threads=2)
    seq = engine.sequence()
    k, v = ctx.kv(300)
    for layer in range(LAYERS):
        seq.append(layer, k, v)
    path = tmp_path / "seq.wkv"
    seq.save(path)
    back = engine.load(str(path))
    assert [back.info(layer) for layer in range(LAYERS)] == [seq.info(layer) for layer in range(LAYERS)]
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(wavekv.CorruptError) as torn:
        engine.load(path)
    assert "section" in torn.value.message or "trailer" in torn.value.message


def test_three_errors(np: Any) -> None:
    ctx = Context(np, 3)
    engine = wavekv.Engine(n_layers=LAYERS, n_q_heads=HQ, n_kv_heads=HKV, head_dim=D, dtype="f32",
                           threads=2)
    seq = engine.sequence()
    k, v = ctx.kv(16)
    # a bad shape: refused by the binding before calling in
    with pytest.raises(wavekv.InvalidArgumentError) as bad_shape:
        seq.append(0, k[:, :1], v[:, :1])
    assert bad_shape.value.status == 1 and bad_shape.value.status_name == "WKV_ERR_INVALID_ARGUMENT"
    assert "shape (16, 1, 128)" in bad_shape.value.message
    # an unknown layer: the library's status and message
    with pytest.raises(wavekv.OutOfRangeError) as unknown_layer:
        seq.append(LAYERS, k, v)
    assert unknown_layer.value.status == 3
    assert "layer %d out of range" % LAYERS in unknown_layer.value.message
    # use after close
    seq.close()
    engine.close()
    for call in (lambda: seq.append(0, k, v), lambda: engine.sequence(), lambda: engine.stats()):
        with pytest.raises(wavekv.InvalidHandleError) as closed:
            call()
        assert closed.value.status == 2 and "closed" in closed.value.message


def test_evict_and_restore_a_sequence(np: Any, tmp_path: Any) -> None:
    ctx = Context(np, 6)
    engine = wavekv.Engine(n_layers=LAYERS, n_q_heads=HQ, n_kv_heads=HKV, head_dim=D, dtype="f32",
                           threads=2, segment_tokens=256, spill_dir=str(tmp_path))
    assert engine.config.spill_dir == str(tmp_path)
    seq = engine.sequence()
    k, v = ctx.kv(700)
    for layer in range(LAYERS):
        seq.append(layer, k, v)
    q = ctx.q()[None]

    def spilled(evicted: bool) -> None:
        for layer in range(LAYERS):
            info = seq.info(layer)
            assert info.pages > 0 and info.evicted == evicted
            assert info.spilled_pages == (info.pages if evicted else 0)

    with engine.plan() as plan:
        before = [plan.decode([seq], layer, q) for layer in range(LAYERS)]
        spilled(False)
        seq.evict()
        spilled(True)
        st = engine.stats()
        assert st.evicted_sequences == 1 and st.spill_bytes_used > 0 and st.spill_io != 0
        assert list(tmp_path.iterdir()) == []  # the spill file has no name
        after = [plan.decode([seq], layer, q) for layer in range(LAYERS)]  # restores
        assert all(np.array_equal(a, b) for a, b in zip(before, after))
        assert engine.stats().evicted_sequences == 0
        spilled(False)
        seq.evict()
        seq.restore()
        spilled(False)
        assert engine.stats().spill_bytes_used == 0
    plain = wavekv.Engine(n_layers=LAYERS, n_q_heads=HQ, n_kv_heads=HKV, head_dim=D, dtype="f32", threads=2)
    with pytest.raises(wavekv.StateError) as no_dir:
        plain.sequence().evict()
    assert "spill_dir" in no_dir.value.message

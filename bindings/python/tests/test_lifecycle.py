"""Engines, sequences and plans close exactly once, deterministically; use
after close raises; the engine's close follows wavekv.h (its sequences and
plans keep working); threads misusing a sequence get an error, not a crash."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
from typing import Any, Callable, List

import pytest

import wavekv
from conftest import env_with_package, small_engine

HQ, HKV, D = 8, 2, 64


def kv(np: Any, n: int, seed: int = 0) -> Any:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, HKV, D)).astype(np.float32),
            rng.standard_normal((n, HKV, D)).astype(np.float32))


def q_of(np: Any, n: int = 1, seed: int = 1) -> Any:
    return np.random.default_rng(seed).standard_normal((n, HQ, D)).astype(np.float32)


def test_config_defaults_come_from_the_library() -> None:
    cfg = wavekv.Config(n_layers=1, n_q_heads=HQ, n_kv_heads=HKV, head_dim=D)
    assert (cfg.dtype, cfg.device, cfg.segment_tokens, cfg.cluster_tokens) == ("f16", "cpu", 8192, 16)
    assert (cfg.sink_tokens, cfg.window_tokens, cfg.retrieval_frac) == (4, 64, 0.018)
    with wavekv.Engine(cfg, dtype="float32", threads=1) as eng:
        assert eng.config.dtype == "f32" and eng.config.threads == 1
        assert eng.config.n_q_heads == HQ and eng.device == "cpu"


def test_dtype_aliases(np: Any) -> None:
    for alias, name in (("float16", "f16"), (np.float32, "f32"), (np.dtype("float16"), "f16"),
                        ("bfloat16", "bf16"), ("half", "f16"), (0, "f32")):
        assert wavekv.Config(n_layers=1, n_q_heads=HQ, n_kv_heads=HKV, head_dim=D,
                             dtype=alias).dtype == name
    assert wavekv.Config(n_layers=1, n_q_heads=HQ, n_kv_heads=HKV, head_dim=D,
                         device="cuda:3").device_id == 3


def test_int8_pages(np: Any, exact: Any) -> None:
    for value in ("int8", "INT8", 1, wavekv.PAGE_FORMAT_INT8):
        assert wavekv.Config(n_layers=1, n_q_heads=HQ, n_kv_heads=HKV, head_dim=D,
                             page_format=value).page_format == "int8"
    assert wavekv.Config(n_layers=1, n_q_heads=HQ, n_kv_heads=HKV, head_dim=D).page_format == "storage"
    for value in ("int8-centered", 2, wavekv.PAGE_FORMAT_INT8_CENTERED):
        assert wavekv.Config(n_layers=1, n_q_heads=HQ, n_kv_heads=HKV, head_dim=D,
                             page_format=value).page_format == "int8-centered"
    for bad in ("int4", 3, True, None):
        with pytest.raises(wavekv.InvalidArgumentError, match="page_format"):
            wavekv.Config(n_layers=1, n_q_heads=HQ, n_kv_heads=HKV, head_dim=D, page_format=bad)
    # Enough tokens that segments are clustered (their rows kept in 8 bits);
    # every cluster retrieved, so the output is attention over the 8-bit rows.
    # Centered keys likewise, keys less their clusters' centroids.
    for fmt in (wavekv.PAGE_FORMAT_INT8, wavekv.PAGE_FORMAT_INT8_CENTERED):
        with small_engine(page_format=fmt, segment_tokens=256, retrieval_frac=1.0,
                          estimation_frac=0.0) as eng, eng.sequence() as seq, eng.plan() as plan:
            assert eng.config.page_format == fmt and eng.dtype == "f32"
            k, v = kv(np, 600)
            seq.append(0, k, v)
            seq.end_prompt(0)
            info = seq.info(0)
            assert info.tokens == 600 and info.clustered > 0, info
            q = q_of(np)
            out = plan.decode([seq], 0, q)
            want = exact(q[0], k, v)
            assert np.linalg.norm(out[0] - want) < 0.05 * np.linalg.norm(want), fmt


def test_environment_overrides_show_in_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WKV_RETRIEVAL_FRAC", "0.5")
    monkeypatch.setenv("WKV_PAGE_FORMAT", "1")
    with small_engine() as eng:
        assert eng.config.retrieval_frac == 0.5
        assert eng.config.page_format == wavekv.PAGE_FORMAT_INT8


def test_with_blocks_close_and_close_is_idempotent(np: Any) -> None:
    with small_engine() as eng:
        with eng.sequence() as seq, eng.plan() as plan:
            assert not seq.closed and not plan.closed
            assert eng.stats().sequences == 1
        assert seq.closed and plan.closed
        st = eng.stats()
        assert st.sequences == 0
        # libwavekv 0.13: a CPU engine's memory is all host memory.
        assert (st.device_bytes_reserved, st.device_bytes_used, st.meta_device_bytes,
                st.meta_host_rows_reserved) == (0, 0, 0, 0)
        seq.close()
        plan.close()
    assert eng.closed
    eng.close()


def closed_calls(np: Any, eng: wavekv.Engine, seq: wavekv.Sequence, plan: wavekv.Plan
                 ) -> List[Callable[[], Any]]:
    k, v = kv(np, 4)
    q = q_of(np)
    out = np.zeros((1, HQ, D), dtype=np.float32)
    lse = np.zeros((1, HQ), dtype=np.float32)
    return [
        eng.stats, eng.stats_json, eng.sequence, eng.plan,
        lambda: seq.append(0, k, v), lambda: seq.end_prompt(0), lambda: seq.info(0),
        lambda: plan.decode([seq], 0, q), lambda: plan.lookup([seq], 0, q), plan.assemble,
        plan.xbuf, lambda: plan.attend(out), lambda: plan.merge(out, lse), plan.update,
        lambda: plan.bind([seq]), plan.prepare, plan.unbind,
    ]


def test_every_method_raises_after_close(np: Any) -> None:
    eng = small_engine()
    seq, plan = eng.sequence(), eng.plan()
    calls = closed_calls(np, eng, seq, plan)
    for obj in (plan, seq, eng):
        obj.close()
    for call in calls:
        with pytest.raises(wavekv.InvalidHandleError, match="closed") as info:
            call()
        assert info.value.status == 2
        assert isinstance(info.value, ValueError)


def test_sequences_and_plans_outlive_their_engine(np: Any, exact: Any) -> None:
    eng = small_engine(retrieval_frac=1.0, estimation_frac=0.0)
    seq, plan = eng.sequence(), eng.plan()
    eng.close()
    with pytest.raises(wavekv.InvalidHandleError):
        eng.stats()
    k, v = kv(np, 200)
    seq.append(0, k, v)
    q = q_of(np)
    out = plan.decode([seq], 0, q)
    np.testing.assert_allclose(out[0], exact(q[0], k, v), atol=1e-5)
    assert seq.engine is eng
    plan.close()
    seq.close()


def test_closed_sequence_in_a_batch(np: Any) -> None:
    with small_engine() as eng, eng.plan() as plan, eng.sequence() as live:
        k, v = kv(np, 8)
        live.append(0, k, v)
        dead = eng.sequence()
        dead.append(0, k, v)
        dead.close()
        with pytest.raises(wavekv.InvalidHandleError, match="sequence is closed"):
            plan.decode([live, dead], 0, q_of(np, 2))
        # the live sequence was released again
        assert live.info(0).tokens == 8
        plan.decode([live], 0, q_of(np, 1))


def test_garbage_collection_closes_as_a_fallback(np: Any) -> None:
    with small_engine() as eng:
        seq = eng.sequence()
        seq.append(0, *kv(np, 8))
        assert eng.stats().sequences == 1
        del seq
        gc.collect()
        assert eng.stats().sequences == 0


FORK_SCRIPT = r"""
import os, sys
import numpy as np
import wavekv
eng = wavekv.Engine(n_layers=1, n_q_heads=8, n_kv_heads=2, head_dim=64, dtype="f32", threads=2)
seq, plan = eng.sequence(), eng.plan()
rng = np.random.default_rng(0)
k, v = (rng.standard_normal((600, 2, 64)).astype(np.float32) for _ in range(2))
seq.append(0, k, v)
q = rng.standard_normal((1, 8, 64)).astype(np.float32)
plan.decode([seq], 0, q)
pid = os.fork()
if pid == 0:
    try:
        seq.append(0, k[:1], v[:1])
        sys.exit(3)  # the parent's sequence must be refused here
    except wavekv.StateError as err:
        assert "another process" in str(err), err
    with wavekv.Engine(n_layers=1, n_q_heads=8, n_kv_heads=2, head_dim=64, dtype="f32") as mine:
        with mine.sequence() as s2, mine.plan() as p2:
            s2.append(0, k, v)
            p2.decode([s2], 0, q)
    sys.exit(0)  # the interpreter's exit closes seq, plan and eng: it must return
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
seq.append(0, k[:8], v[:8])
plan.decode([seq], 0, q)
print("parent", seq.info(0).tokens)
"""


def test_a_forked_child_refuses_its_parents_handles_and_exits() -> None:
    # In a script of its own: a fork inside pytest's process would run
    # pytest on in the child. The child's exit closes the parent's objects
    # through their finalizers; that used to wait forever for engine
    # threads that do not exist in a child.
    result = subprocess.run([sys.executable, "-c", FORK_SCRIPT], env=env_with_package(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == ["child", "0", "parent", "608"], result.stdout + result.stderr


def test_second_thread_inside_a_sequence_is_refused() -> None:
    with small_engine() as eng, eng.sequence() as seq:
        # Stand in for another thread being inside a call on seq.
        assert seq._lock.acquire(blocking=False)
        try:
            with pytest.raises(wavekv.StateError, match="in use by another thread"):
                seq.info(0)
        finally:
            seq._lock.release()
        assert seq.info(0).tokens == 0


def test_threads_share_an_engine(np: Any, exact: Any) -> None:
    errors: List[BaseException] = []
    with small_engine(retrieval_frac=1.0, estimation_frac=0.0, threads=2) as eng:

        def work(seed: int) -> None:
            try:
                with eng.sequence() as seq, eng.plan() as plan:
                    k, v = kv(np, 300, seed)
                    seq.append(0, k, v)
                    seq.end_prompt(0)
                    for step in range(5):
                        q = q_of(np, 1, seed * 100 + step)
                        out = plan.decode([seq], 0, q)
                        np.testing.assert_allclose(out[0], exact(q[0], k, v), atol=1e-5)
                        eng.stats()
            except BaseException as exc:  # noqa: BLE001 (reported below)
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert eng.stats().lookups == 20
    assert not errors, errors


def test_plan_steps_match_decode(np: Any, exact: Any) -> None:
    """lookup, assemble, xbuf, the caller's own attention, merge and update
    give what attend gives; the execution buffer holds the sequence's keys."""
    with small_engine(segment_tokens=256) as eng, eng.plan() as plan, \
            eng.sequence() as s0, eng.sequence() as s1:
        data = [kv(np, 700, 10), kv(np, 500, 11)]
        for seq, (k, v) in zip((s0, s1), data):
            seq.append(0, k, v)
        q = q_of(np, 2)
        with pytest.raises(wavekv.StateError):
            plan.attend()
        plan.lookup([s0, s1], 0, q)
        plan.assemble()
        x = plan.xbuf()
        assert x.n_runs == 2 * HKV and x.head_dim == D and x.dtype == "f32"
        offsets = np.asarray(x.offsets)
        keys, values = np.asarray(x.k), np.asarray(x.v)
        assert offsets[0] == 0 and offsets[-1] == x.n_tokens == len(keys)
        # the caller's attention over each run, with its log-sum-exp
        mine = np.zeros((2, HQ, D), dtype=np.float32)
        mine_lse = np.zeros((2, HQ), dtype=np.float32)
        for s in range(2):
            for h in range(HQ):
                r = s * HKV + h // (HQ // HKV)
                kr = keys[offsets[r]:offsets[r + 1]].astype(np.float64)
                vr = values[offsets[r]:offsets[r + 1]].astype(np.float64)
                # every key of the run is one of the sequence's keys of that head
                k_all = data[s][0][:, h // (HQ // HKV)]
                assert all((k_all == row).all(axis=1).any() for row in kr[:5].astype(np.float32))
                scores = kr @ q[s, h].astype(np.float64) / np.sqrt(D)
                m = scores.max()
                p = np.exp(scores - m)
                mine[s, h] = p @ vr / p.sum()
                mine_lse[s, h] = m + np.log(p.sum())
        theirs = np.zeros((2, HQ, D), dtype=np.float32)
        theirs_lse = np.zeros((2, HQ), dtype=np.float32)
        plan.attend(theirs, theirs_lse)
        plan.merge(mine, mine_lse)
        np.testing.assert_allclose(mine, theirs, atol=2e-5)
        np.testing.assert_allclose(mine_lse, theirs_lse, atol=2e-5)
        plan.update()
        # a new lookup makes the old view stale
        plan.lookup([s0], 0, q[:1])
        with pytest.raises(wavekv.StateError, match="stale"):
            np.asarray(x.k)
        with pytest.raises(wavekv.StateError):
            plan.attend()  # the new lookup has had no assemble


def test_lse_checks(np: Any) -> None:
    with small_engine() as eng, eng.plan() as plan, eng.sequence() as seq:
        seq.append(0, *kv(np, 100))
        plan.lookup([seq], 0, q_of(np))
        plan.assemble()
        out = np.zeros((1, HQ, D), dtype=np.float32)
        with pytest.raises(wavekv.InvalidArgumentError, match="lse has dtype"):
            plan.attend(out, np.zeros((1, HQ), dtype=np.float64))
        with pytest.raises(wavekv.InvalidArgumentError, match="contiguous"):
            plan.merge(out, np.zeros((1, 2 * HQ), dtype=np.float32)[:, ::2])
        with pytest.raises(wavekv.InvalidArgumentError, match="shape"):
            plan.merge(out, np.zeros((HQ,), dtype=np.float32))

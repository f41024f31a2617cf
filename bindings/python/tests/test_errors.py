"""Each status code raises its own exception class, carrying the status and the
library's message; real library failures map to those classes."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

import wavekv
from conftest import small_engine
from wavekv import errors

CLASSES = {
    1: wavekv.InvalidArgumentError,
    2: wavekv.InvalidHandleError,
    3: wavekv.OutOfRangeError,
    4: wavekv.UnsupportedError,
    5: wavekv.BudgetError,
    6: wavekv.OutOfMemoryError,
    7: wavekv.DeviceError,
    8: wavekv.FileIOError,
    9: wavekv.CorruptError,
    10: wavekv.StateError,
    11: wavekv.InternalError,
    12: wavekv.NoDeviceError,
}


@pytest.mark.parametrize("status", sorted(CLASSES))
def test_each_status_has_its_class(status: int) -> None:
    exc = errors.error_for_status(status, "what went wrong")
    assert type(exc) is CLASSES[status]
    assert isinstance(exc, wavekv.WavekvError)
    assert exc.status == status and exc.message == "what went wrong"
    # The binding's names are the header's (wkv_status_name).
    lib_name = wavekv._lib.lib().wkv_status_name(status).decode()
    assert exc.status_name == lib_name
    assert str(exc) == "%s: what went wrong" % lib_name
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is type(exc) and again.status == status and again.message == exc.message


def test_unknown_status_is_the_base_class() -> None:
    exc = errors.error_for_status(99, "from the future")
    assert type(exc) is wavekv.WavekvError
    assert exc.status == 99 and "99" in exc.status_name


def test_python_conventions() -> None:
    assert issubclass(wavekv.InvalidArgumentError, ValueError)
    assert issubclass(wavekv.InvalidHandleError, ValueError)
    assert issubclass(wavekv.OutOfRangeError, IndexError)
    assert not issubclass(wavekv.FileIOError, OSError)  # does not shadow IOError


def test_malformed_config_is_invalid_argument_with_library_message() -> None:
    with pytest.raises(wavekv.InvalidArgumentError) as info:
        wavekv.Engine(n_layers=1, n_q_heads=4, n_kv_heads=3, head_dim=64)
    assert info.value.status == 1
    assert "n_kv_heads" in info.value.message


def test_missing_shape_is_refused() -> None:
    with pytest.raises(TypeError):
        wavekv.Config(n_layers=1)  # type: ignore[call-arg]
    with pytest.raises(wavekv.InvalidArgumentError):
        wavekv.Engine(n_layers=0, n_q_heads=4, n_kv_heads=2, head_dim=64)


def test_unsupported_head_dim() -> None:
    with pytest.raises(wavekv.UnsupportedError) as info:
        wavekv.Engine(n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=72)
    assert info.value.status == 4 and "72" in info.value.message


def test_cuda_engine_without_gpu_or_cuda_build() -> None:
    try:
        eng = wavekv.Engine(n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=64, device="cuda")
    except (wavekv.UnsupportedError, wavekv.NoDeviceError) as exc:
        assert exc.message
    else:
        with eng:
            assert eng.device == "cuda"
        pytest.skip("a GPU is usable here: the refusal cannot be provoked")


def test_environment_override_malformed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WKV_THREADS", "two")
    with pytest.raises(wavekv.InvalidArgumentError) as info:
        small_engine()
    assert "WKV_THREADS" in info.value.message


def test_config_values_checked_before_calling_in() -> None:
    with pytest.raises(wavekv.InvalidArgumentError, match="n_layers"):
        wavekv.Config(n_layers=-1, n_q_heads=4, n_kv_heads=2, head_dim=64).to_c()
    with pytest.raises(wavekv.InvalidArgumentError, match="seed"):
        wavekv.Config(n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=64, seed=1 << 64).to_c()
    with pytest.raises(wavekv.InvalidArgumentError, match="dtype"):
        wavekv.Config(n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=64, dtype="f64")
    with pytest.raises(wavekv.InvalidArgumentError, match="device"):
        wavekv.Config(n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=64, device="tpu")


def test_out_of_range_layer(np: Any) -> None:
    with small_engine() as eng, eng.sequence() as seq:
        kv = np.zeros((4, 2, 64), dtype=np.float32)
        with pytest.raises(wavekv.OutOfRangeError) as info:
            seq.append(2, kv, kv)
        assert info.value.status == 3
        assert "layer 2" in info.value.message and info.value.message.startswith("wkv_")
        with pytest.raises(wavekv.OutOfRangeError):
            seq.info(-1)


def test_non_finite_input_is_refused(np: Any) -> None:
    # One NaN key used to silence its head for good (zeros, lse -inf).
    with small_engine(n_layers=1) as eng, eng.sequence() as seq, eng.plan() as plan:
        rng = np.random.default_rng(0)
        k = rng.standard_normal((300, 2, 64)).astype(np.float32)
        seq.append(0, k, k)
        q = rng.standard_normal((1, 8, 64)).astype(np.float32)
        before = plan.decode([seq], 0, q)
        bad = k.copy()
        bad[150, 0, 7] = np.nan
        with pytest.raises(wavekv.InvalidArgumentError, match="k holds a NaN or an infinity"):
            seq.append(0, bad, k)
        assert seq.info(0).tokens == 300
        q_bad = q.copy()
        q_bad[0, 2, 0] = np.inf
        with pytest.raises(wavekv.InvalidArgumentError, match="q holds a NaN"):
            plan.decode([seq], 0, q_bad)
        np.testing.assert_array_equal(plan.decode([seq], 0, q), before)


def test_budget(np: Any) -> None:
    # Small segments: the append itself clusters, and so takes pages.
    with small_engine(host_budget_bytes=1 << 16, segment_tokens=256) as eng, \
            eng.sequence() as seq:
        kv = np.ones((4096, 2, 64), dtype=np.float32)
        with pytest.raises(wavekv.BudgetError) as info:
            seq.append(0, kv, kv)
        assert info.value.status == 5 and info.value.message
        assert seq.info(0).tokens == 0  # nothing appended on error


def test_state_assemble_before_lookup() -> None:
    with small_engine() as eng, eng.plan() as plan:
        with pytest.raises(wavekv.StateError) as info:
            plan.assemble()
        assert info.value.status == 10 and "lookup" in info.value.message


def test_sequence_of_another_engine(np: Any) -> None:
    with small_engine() as a, small_engine() as b, a.plan() as plan, b.sequence() as seq:
        kv = np.ones((8, 2, 64), dtype=np.float32)
        seq.append(0, kv, kv)
        with pytest.raises(wavekv.InvalidHandleError) as info:
            plan.decode([seq], 0, np.ones((1, 8, 64), dtype=np.float32))
        assert info.value.status == 2 and info.value.message.startswith("wkv_")


def test_sequence_listed_twice(np: Any) -> None:
    with small_engine() as eng, eng.sequence() as seq, eng.plan() as plan:
        kv = np.ones((8, 2, 64), dtype=np.float32)
        seq.append(0, kv, kv)
        with pytest.raises(wavekv.InvalidArgumentError) as info:
            plan.decode([seq, seq], 0, np.ones((2, 8, 64), dtype=np.float32))
        assert info.value.message.startswith("wkv_")
        # the sequence is usable afterwards (the binding released it)
        assert seq.info(0).tokens == 8


def test_binding_a_plan_needs_a_cuda_engine(np: Any) -> None:
    # Steps a runtime captures (wkv_plan_bind, 0.9): a CPU engine refuses the
    # binding, leaving the plan unbound (prepare and unbind: StateError) and
    # the plan and its sequences usable.
    with small_engine() as eng, eng.sequence() as a, eng.sequence() as b, eng.plan() as plan:
        kv = np.ones((8, 2, 64), dtype=np.float32)
        for seq in (a, b):
            for layer in range(2):
                seq.append(layer, kv, kv)
        with pytest.raises(wavekv.UnsupportedError) as info:
            plan.bind([a, b], max_steps=16)
        assert info.value.status == 4 and info.value.message.startswith("wkv_plan_bind: ")
        with pytest.raises(wavekv.UnsupportedError):
            plan.bind(a, stream=0)
        for call, name in ((plan.prepare, "wkv_plan_prepare"), (plan.unbind, "wkv_plan_unbind")):
            with pytest.raises(wavekv.StateError) as info:
                call()
            assert info.value.status == 10
            assert info.value.message.startswith(name + ": ") and "not bound" in info.value.message
        # the binding's checks, before calling in
        with pytest.raises(wavekv.InvalidArgumentError, match="max_steps"):
            plan.bind([a], max_steps=-1)
        with pytest.raises(wavekv.InvalidArgumentError, match="max_steps"):
            plan.bind([a], max_steps=True)
        with pytest.raises(wavekv.InvalidArgumentError, match="no sequences"):
            plan.bind([])
        # not bound: both sequences take appends and the plan decodes
        a.append(0, kv[:1], kv[:1])
        out = plan.decode([a, b], 0, np.ones((2, 8, 64), dtype=np.float32))
        assert np.isfinite(out).all() and a.info(0).tokens == 9

"""Tensors are checked (shape, dtype, device, strides, writability) before the
library is called, and valid strided views are read in place."""

from __future__ import annotations

from typing import Any

import pytest

import wavekv
from conftest import small_engine

T, H, HQ, D = 96, 2, 8, 64


@pytest.fixture
def parts(np: Any) -> Any:
    rng = np.random.default_rng(7)
    k = rng.standard_normal((T, H, D)).astype(np.float32)
    v = rng.standard_normal((T, H, D)).astype(np.float32)
    q = rng.standard_normal((1, HQ, D)).astype(np.float32)
    return k, v, q


def refused_before_call(seq: wavekv.Sequence, exc: pytest.ExceptionInfo, fn: str = "Sequence.append"
                        ) -> None:
    """The binding refused (its message names its method, not a wkv_ function)
    and nothing reached the sequence."""
    assert exc.value.status == 1
    assert exc.value.message.startswith(fn + ":"), exc.value.message
    assert seq.info(0).tokens == 0


@pytest.mark.parametrize("dtype", ["float64", "float16", "int32"])
def test_wrong_dtype(np: Any, parts: Any, dtype: str) -> None:
    k, v, _ = parts
    with small_engine() as eng, eng.sequence() as seq:
        with pytest.raises(wavekv.InvalidArgumentError, match="dtype") as info:
            seq.append(0, k.astype(dtype), v.astype(dtype))
        refused_before_call(seq, info)


@pytest.mark.parametrize("shape", [(T, H * D), (T, 3, D), (T, H, D // 2), (0, H, D), (1, T, H, D)])
def test_wrong_shape(np: Any, shape: tuple) -> None:
    with small_engine() as eng, eng.sequence() as seq:
        bad = np.zeros(shape, dtype=np.float32)
        with pytest.raises(wavekv.InvalidArgumentError, match="shape") as info:
            seq.append(0, bad, bad)
        refused_before_call(seq, info)


def test_k_and_v_token_counts_differ(parts: Any) -> None:
    k, v, _ = parts
    with small_engine() as eng, eng.sequence() as seq:
        with pytest.raises(wavekv.InvalidArgumentError, match="tokens") as info:
            seq.append(0, k, v[:-1])
        refused_before_call(seq, info)


def test_not_a_tensor(parts: Any) -> None:
    k, _, _ = parts
    with small_engine() as eng, eng.sequence() as seq:
        with pytest.raises(wavekv.InvalidArgumentError, match="not a tensor") as info:
            seq.append(0, k.tolist(), k)
        refused_before_call(seq, info)


class FakeCudaArray:
    """Claims to live on a GPU (the CUDA array interface), pointing at host
    memory that must never be read through it."""

    def __init__(self, like: Any) -> None:
        self._like = like
        self.__cuda_array_interface__ = {
            "shape": like.shape, "typestr": "<f4", "data": (like.ctypes.data, False),
            "strides": None, "version": 3}


def test_wrong_device(parts: Any) -> None:
    k, v, _ = parts
    with small_engine() as eng, eng.sequence() as seq:
        with pytest.raises(wavekv.InvalidArgumentError, match="on cuda; this engine takes tensors on cpu") \
                as info:
            seq.append(0, FakeCudaArray(k), v)
        refused_before_call(seq, info)


def test_row_elements_must_be_contiguous(np: Any) -> None:
    wide = np.zeros((T, H, 2 * D), dtype=np.float32)
    with small_engine() as eng, eng.sequence() as seq:
        with pytest.raises(wavekv.InvalidArgumentError, match="contiguous") as info:
            seq.append(0, wide[:, :, ::2], wide[:, :, ::2])
        refused_before_call(seq, info)


def test_negative_strides(parts: Any) -> None:
    k, v, _ = parts
    with small_engine() as eng, eng.sequence() as seq:
        with pytest.raises(wavekv.InvalidArgumentError, match="negative") as info:
            seq.append(0, k[::-1], v[::-1])
        refused_before_call(seq, info)


def test_overlapping_rows(np: Any, parts: Any) -> None:
    k, _, _ = parts
    row = k[:1]
    repeated = np.broadcast_to(row, (T, H, D))  # token stride 0
    with small_engine() as eng, eng.sequence() as seq:
        with pytest.raises(wavekv.InvalidArgumentError, match="overlap") as info:
            seq.append(0, repeated, repeated)
        refused_before_call(seq, info)
        squeezed = np.lib.stride_tricks.as_strided(k, shape=(T, H, D), strides=(4 * D, 4 * D // 2, 4))
        with pytest.raises(wavekv.InvalidArgumentError, match="overlap") as info:
            seq.append(0, squeezed, squeezed)
        refused_before_call(seq, info)


def test_k_and_v_strides_differ(np: Any, parts: Any) -> None:
    k, v, _ = parts
    v_t = np.ascontiguousarray(v.transpose(1, 0, 2)).transpose(1, 0, 2)  # same values, other strides
    with small_engine() as eng, eng.sequence() as seq:
        with pytest.raises(wavekv.InvalidArgumentError, match="same strides") as info:
            seq.append(0, k, v_t)
        refused_before_call(seq, info)


def test_misaligned(np: Any) -> None:
    buf = bytearray(4 * T * H * D + 1)
    k = np.frombuffer(buf, dtype=np.float32, offset=1, count=T * H * D).reshape(T, H, D)
    with small_engine() as eng, eng.sequence() as seq:
        with pytest.raises(wavekv.InvalidArgumentError, match="align") as info:
            seq.append(0, k, k)
        refused_before_call(seq, info)


def test_strided_views_are_read_in_place(np: Any, parts: Any, exact: Any) -> None:
    """A [T][H][d] view sliced from a layout with a wider head, and a
    transposed [H][T][d] layout, give the same result as packed arrays."""
    k, v, q = parts
    wide_k = np.zeros((T, H, D + 32), dtype=np.float32)
    wide_v = np.zeros((T, H, D + 32), dtype=np.float32)
    wide_k[:, :, 16:16 + D], wide_v[:, :, 16:16 + D] = k, v
    k_view, v_view = wide_k[:, :, 16:16 + D], wide_v[:, :, 16:16 + D]
    k_t = np.ascontiguousarray(k.transpose(1, 0, 2)).transpose(1, 0, 2)  # memory [H][T][d]
    v_t = np.ascontiguousarray(v.transpose(1, 0, 2)).transpose(1, 0, 2)
    assert not k_view.flags.c_contiguous and not k_t.flags.c_contiguous
    wide_q = np.zeros((3, HQ, D + 8), dtype=np.float32)
    wide_q[:, :, :D] = q[0]
    q_view = wide_q[:, :, :D]
    with small_engine(retrieval_frac=1.0, estimation_frac=0.0) as eng, eng.plan() as plan, \
            eng.sequence() as a, eng.sequence() as b, eng.sequence() as c:
        a.append(0, k, v)
        b.append(0, k_view, v_view)
        c.append(0, k_t, v_t)
        out = np.full((3, HQ, D + 4), np.nan, dtype=np.float32)
        result = plan.decode([a, b, c], 0, q_view, out=out[:, :, 2:2 + D])
        assert result.base is out  # the very view passed in, filled in place
        np.testing.assert_array_equal(out[1, :, 2:2 + D], out[0, :, 2:2 + D])
        np.testing.assert_array_equal(out[2, :, 2:2 + D], out[0, :, 2:2 + D])
        np.testing.assert_allclose(out[0, :, 2:2 + D], exact(q[0], k, v), atol=2e-5)
        assert np.isnan(out[:, :, :2]).all() and np.isnan(out[:, :, 2 + D:]).all()


def test_output_checks(np: Any, parts: Any) -> None:
    k, v, q = parts
    with small_engine() as eng, eng.sequence() as seq, eng.plan() as plan:
        seq.append(0, k, v)
        readonly = np.zeros((1, HQ, D), dtype=np.float32)
        readonly.setflags(write=False)
        with pytest.raises(wavekv.InvalidArgumentError, match="read-only"):
            plan.decode([seq], 0, q, out=readonly)
        with pytest.raises(wavekv.InvalidArgumentError, match="dtype"):
            plan.decode([seq], 0, q, out=np.zeros((1, HQ, D), dtype=np.float64))
        with pytest.raises(wavekv.InvalidArgumentError, match="shape"):
            plan.decode([seq], 0, q, out=np.zeros((2, HQ, D), dtype=np.float32))
        with pytest.raises(wavekv.InvalidArgumentError, match="shape"):
            plan.decode([seq], 0, np.zeros((2, HQ, D), dtype=np.float32))
        assert seq.info(0).generating is False  # no lookup reached the library
        out = plan.decode([seq], 0, q)
        assert isinstance(out, np.ndarray) and out.shape == (1, HQ, D) and out.dtype == np.float32


def test_f16_engine(np: Any, parts: Any, exact: Any) -> None:
    k, v, q = parts
    with small_engine(dtype="f16", retrieval_frac=1.0, estimation_frac=0.0) as eng, \
            eng.sequence() as seq, eng.plan() as plan:
        assert eng.dtype == "f16"
        with pytest.raises(wavekv.InvalidArgumentError, match="dtype float32; expected float16"):
            seq.append(0, k, v)
        seq.append(0, k.astype(np.float16), v.astype(np.float16))
        out = plan.decode([seq], 0, q.astype(np.float16))
        assert out.dtype == np.float16
        ref = exact(q[0].astype(np.float16), k.astype(np.float16), v.astype(np.float16))
        np.testing.assert_allclose(out[0].astype(np.float64), ref, atol=3e-3)


def test_layer_must_be_an_int(np: Any, parts: Any) -> None:
    k, v, _ = parts
    with small_engine() as eng, eng.sequence() as seq:
        for bad in (0.0, True, "0"):
            with pytest.raises(wavekv.InvalidArgumentError, match="layer"):
                seq.append(bad, k, v)  # type: ignore[arg-type]
        with pytest.raises(wavekv.OutOfRangeError):
            seq.append(-1, k, v)
        seq.append(np.int64(1), k, v)  # any integer type
        assert seq.info(1).tokens == T


def test_numpy_bfloat16(np: Any, parts: Any, exact: Any) -> None:
    """NumPy arrays of ml_dtypes' bfloat16 (which NumPy cannot export through
    DLPack) are read through the array interface."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = ml_dtypes.bfloat16
    k, v, q = (a.astype(bf16) for a in parts)
    with small_engine(dtype="bf16", retrieval_frac=1.0, estimation_frac=0.0) as eng, \
            eng.sequence() as seq, eng.plan() as plan:
        seq.append(0, k, v)
        out = plan.decode([seq], 0, q)
        assert out.dtype == bf16
        ref = exact(q[0].astype(np.float64), k.astype(np.float64), v.astype(np.float64))
        np.testing.assert_allclose(out[0].astype(np.float64), ref, atol=2e-2)
        with pytest.raises(wavekv.InvalidArgumentError, match="dtype float16; expected bfloat16"):
            seq.append(0, k.astype(np.float16), v.astype(np.float16))


def test_no_reference_leak(np: Any, parts: Any) -> None:
    """The DLPack capsules are dropped after each call (their producer's
    destructor releases the array)."""
    import sys

    k, v, q = parts
    before = (sys.getrefcount(k), sys.getrefcount(v), sys.getrefcount(q))
    with small_engine() as eng, eng.sequence() as seq, eng.plan() as plan:
        for _ in range(20):
            seq.append(0, k, v)
            plan.decode([seq], 0, q)
    assert (sys.getrefcount(k), sys.getrefcount(v), sys.getrefcount(q)) == before

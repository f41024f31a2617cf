"""JAX arrays (host) through DLPack (skipped visibly where JAX is not installed)."""

from __future__ import annotations

import os
from typing import Any

import pytest

import wavekv
from conftest import small_engine

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # keep JAX off the GPU that torch tests use
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


def test_jax_inputs(np: Any, exact: Any) -> None:
    rng = np.random.default_rng(5)
    k_np = rng.standard_normal((200, 2, 64)).astype(np.float32)
    v_np = rng.standard_normal((200, 2, 64)).astype(np.float32)
    q_np = rng.standard_normal((1, 8, 64)).astype(np.float32)
    cpu = jax.devices("cpu")[0]
    k, v, q = (jax.device_put(jnp.asarray(a), cpu) for a in (k_np, v_np, q_np))
    with small_engine(retrieval_frac=1.0, estimation_frac=0.0) as eng, \
            eng.sequence() as seq, eng.plan() as plan:
        seq.append(0, k, v)
        out = plan.decode([seq], 0, q)  # allocated with NumPy: JAX arrays are immutable
        assert isinstance(out, np.ndarray)
        np.testing.assert_allclose(out[0], exact(q_np[0], k_np, v_np), atol=1e-5)
        with pytest.raises(wavekv.InvalidArgumentError, match="read-only"):
            plan.decode([seq], 0, q, out=jnp.zeros((1, 8, 64), dtype=jnp.float32))
        with pytest.raises(wavekv.InvalidArgumentError, match="dtype"):
            seq.append(0, k.astype(jnp.float16), v.astype(jnp.float16))

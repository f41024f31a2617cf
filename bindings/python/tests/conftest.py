"""Shared fixtures: the package from this checkout, exact attention in NumPy."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1]   # bindings/python
REPO_ROOT = PACKAGE_DIR.parents[1]

# The package is tested from its source; installing it is tested apart.
if str(PACKAGE_DIR) not in sys.path:
    sys.path.insert(0, str(PACKAGE_DIR))

import wavekv  # noqa: E402


def pytest_report_header(config: Any) -> str:
    try:
        where = "%s (%s)" % (wavekv.library_path(), wavekv.library_version())
    except wavekv.LibraryNotFoundError as exc:
        where = "not found: %s" % exc
    return "wavekv package: %s\nlibwavekv: %s" % (wavekv.__file__, where)


@pytest.fixture(scope="session")
def np() -> Any:
    return pytest.importorskip("numpy")


def exact_attention(np: Any, q: Any, k: Any, v: Any) -> Any:
    """Exact attention in float64. q [n_q_heads][d]; k, v [tokens][n_kv_heads][d]
    -> [n_q_heads][d]. Query head h reads KV head h // (n_q_heads / n_kv_heads)."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    n_q, d = q.shape
    group = n_q // k.shape[1]
    kv = np.arange(n_q) // group
    scores = np.einsum("hd,thd->ht", q, k[:, kv, :]) / np.sqrt(d)
    scores -= scores.max(axis=1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=1, keepdims=True)
    return np.einsum("ht,thd->hd", p, v[:, kv, :])


@pytest.fixture
def exact(np: Any) -> Any:
    return lambda q, k, v: exact_attention(np, q, k, v)


def small_engine(**fields: Any) -> "wavekv.Engine":
    base = dict(n_layers=2, n_q_heads=8, n_kv_heads=2, head_dim=64, dtype="f32", threads=2)
    base.update(fields)
    return wavekv.Engine(**base)


@pytest.fixture
def engine() -> Any:
    with small_engine() as eng:
        yield eng


def env_with_package(**extra: str) -> dict:
    """The environment for a child python that imports this checkout's package."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(PACKAGE_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(extra)
    return env

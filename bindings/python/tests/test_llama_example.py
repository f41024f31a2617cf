"""The transformers example (skipped visibly without torch and transformers):
at full retrieval its greedy tokens are the unmodified model's."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import List

import pytest

from conftest import PACKAGE_DIR, env_with_package

pytest.importorskip("torch")
pytest.importorskip("transformers")

EXAMPLE = PACKAGE_DIR / "examples" / "llama_decode.py"
SMALL = ["--prompt-len", "600", "--steps", "8", "--layers", "3"]


def run_example(args: List[str]) -> str:
    result = subprocess.run([sys.executable, str(EXAMPLE)] + args, env=env_with_package(),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    print(result.stdout)
    return result.stdout


def agreement(out: str) -> int:
    m = re.search(r"greedy tokens: (\d+)/(\d+) agree", out)
    assert m, out
    return int(m.group(1))


def test_full_retrieval_gives_the_models_tokens() -> None:
    out = run_example(SMALL + ["--device", "cpu", "--retrieval", "1.0", "--require-identical"])
    assert "(identical)" in out
    diff = float(re.search(r"max \|logit diff\| (\S+)", out).group(1))
    assert diff < 1e-3


def test_default_budget_reports_agreement() -> None:
    out = run_example(SMALL + ["--device", "cpu"])
    assert "teacher-forced: argmax agrees at" in out
    assert 0 <= agreement(out) <= 16


def test_cuda_engine_full_retrieval() -> None:
    import torch

    import wavekv

    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    try:
        wavekv.Engine(n_layers=1, n_q_heads=2, n_kv_heads=1, head_dim=128, device="cuda").close()
    except (wavekv.UnsupportedError, wavekv.NoDeviceError) as exc:
        pytest.skip("libwavekv cannot open a CUDA engine here: %s" % exc)
    out = run_example(["--device", "cuda", "--retrieval", "1.0", "--require-identical"])
    assert "(identical)" in out

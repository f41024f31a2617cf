"""The package installs with pip (no compiler, no network) and finds
libwavekv as the README says."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Optional

import pytest

from conftest import PACKAGE_DIR, REPO_ROOT

PROBE = "import wavekv, sys; print(wavekv.__file__); print(wavekv.library_path())"

SMOKE = """
import wavekv, sys
from pathlib import Path
with wavekv.Engine(n_layers=1, n_q_heads=2, n_kv_heads=1, head_dim=64, dtype="f32") as e:
    assert e.stats().sequences == 0
assert (Path(wavekv.__file__).parent / "py.typed").is_file()
print(wavekv.__file__)
"""


def run(code: str, env: Dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=str(cwd),
                          capture_output=True, text=True, timeout=120)


def clean_env(**extra: Optional[str]) -> Dict[str, str]:
    """The environment without the package's source or WAVEKV_LIBRARY (the
    loader path stays: libwavekv's own dependencies may need it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "WAVEKV_LIBRARY")}
    env.update({k: v for k, v in extra.items() if v is not None})
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package installed by pip into a folder outside the checkout."""
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode:
        pytest.skip("pip is not available for %s" % sys.executable)
    # Without build isolation the build uses what is installed: setuptools,
    # and before setuptools 70.1 the wheel package (bdist_wheel).
    probe = ("import setuptools, sys\n"
             "v = tuple(int(x) for x in setuptools.__version__.split('.')[:2] if x.isdigit())\n"
             "if v < (70, 1): import wheel\n")
    if subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode:
        pytest.skip("setuptools (and, before setuptools 70.1, wheel) are not installed for %s: "
                    "pip install --no-build-isolation needs them" % sys.executable)
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    # A copy, so that the build leaves nothing in the tree.
    shutil.copytree(str(PACKAGE_DIR), str(src), ignore=shutil.ignore_patterns(
        "tests", "examples", "build", "*.egg-info", "__pycache__"))
    target = tmp / "site"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
         "--no-index", "--disable-pip-version-check", "--target", str(target), str(src)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return target


def test_pip_install_and_import(installed: Path, tmp_path: Path) -> None:
    lib = os.environ.get("WAVEKV_LIBRARY") or _tree_library()
    result = run(SMOKE, clean_env(PYTHONPATH=str(installed), WAVEKV_LIBRARY=lib), tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(str(installed))


def _tree_library() -> str:
    import wavekv

    return wavekv.library_path()


def test_found_on_the_loader_path(installed: Path, tmp_path: Path) -> None:
    lib = Path(_tree_library())
    loader_path = os.pathsep.join([str(lib.parent)] + [
        p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p])
    env = clean_env(PYTHONPATH=str(installed), LD_LIBRARY_PATH=loader_path)
    result = run(PROBE, env, tmp_path)
    assert result.returncode == 0, result.stderr
    where = result.stdout.splitlines()[1]
    assert Path(where).resolve().parent == lib.resolve().parent, where


def test_not_found_says_where_it_looked(installed: Path, tmp_path: Path) -> None:
    result = run(PROBE, clean_env(PYTHONPATH=str(installed)), tmp_path)
    if result.returncode == 0:
        pytest.skip("a libwavekv is on this system's library path: %s"
                    % result.stdout.splitlines()[-1])
    assert "LibraryNotFoundError" in result.stderr
    for place in ("find_library", "LD_LIBRARY_PATH", "/usr/local/lib", "WAVEKV_LIBRARY"):
        assert place in result.stderr, result.stderr


def test_wavekv_library_is_the_only_candidate(tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere" / "libwavekv.so")
    env = clean_env(PYTHONPATH=str(PACKAGE_DIR), WAVEKV_LIBRARY=missing)
    result = run(PROBE, env, tmp_path)
    assert result.returncode != 0 and "LibraryNotFoundError" in result.stderr
    assert missing in result.stderr


def test_found_in_the_checkout(tmp_path: Path) -> None:
    libs = [p for p in REPO_ROOT.glob("build*/lib/libwavekv.so*")]
    if not libs:
        pytest.skip("no build of libwavekv in %s/build*/lib" % REPO_ROOT)
    result = run(PROBE, clean_env(PYTHONPATH=str(PACKAGE_DIR)), tmp_path)
    assert result.returncode == 0, result.stderr
    where = Path(result.stdout.splitlines()[1]).resolve()
    assert where.parent.parent.parent == REPO_ROOT.resolve(), where
    assert where.parent.parent.name.startswith("build")


def test_import_does_not_load_the_library(tmp_path: Path) -> None:
    env = clean_env(PYTHONPATH=str(PACKAGE_DIR), WAVEKV_LIBRARY=str(tmp_path / "none.so"))
    result = run("import wavekv; print(wavekv.__version__)", env, tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == "0.1.0", result.stderr



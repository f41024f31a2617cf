"""The README's example works as written."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

from conftest import PACKAGE_DIR, env_with_package


def readme_example() -> str:
    text = (PACKAGE_DIR / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README.md has no python block"
    return blocks[0]


def test_example_is_about_ten_lines() -> None:
    lines = [line for line in readme_example().splitlines() if line.strip()]
    assert len(lines) <= 10, lines


def test_example_runs_as_written(np: Any, tmp_path: Any) -> None:
    result = subprocess.run([sys.executable, "-c", readme_example()], cwd=str(tmp_path),
                            env=env_with_package(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    shape, attended = result.stdout.split(")")
    assert shape.strip() == "(1, 8, 64" and int(attended) > 0, result.stdout

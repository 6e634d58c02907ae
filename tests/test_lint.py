"""The repository's own checks run with the suite: ruff everywhere, mypy strict on the
torch-free core and scheduler (pyproject's [tool.mypy] files)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is a test extra")
def test_ruff_is_clean() -> None:
    result = subprocess.run(
        ["ruff", "check", "hybridkv", "tests", "benchmarks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_core_and_scheduler_are_mypy_strict_clean() -> None:
    pytest.importorskip("mypy")
    result = subprocess.run(
        [sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr

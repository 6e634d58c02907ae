"""Engine tests reuse the tiny-checkpoint helpers of tests/models (imported by bare name)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))

from engine_checkpoints import ARCH, ARCHITECTURES, OPTIONS, build_checkpoint


@pytest.fixture(scope="session", autouse=True)
def _two_threads() -> None:
    torch.set_num_threads(2)


@pytest.fixture
def just_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines started in the test compile the GDN decode step just in time (the form
    whose compiles, graphs and calls these tests count) instead of loading its package
    compiled ahead of time (hybridkv.ops.ahead_of_time: tests/ops/test_ahead_of_time.py
    and the engine tests that name it)."""
    from hybridkv.ops import ahead_of_time

    monkeypatch.setenv(ahead_of_time.CACHE_ENV, "off")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """arch -> (transformers model, checkpoint dir), built once per session on first use."""
    built: dict[str, tuple[Any, Path]] = {}

    def get(arch: str) -> tuple[Any, Path]:
        if arch not in built:
            model_dir = tmp_path_factory.mktemp(f"engine_{arch}")
            built[arch] = (build_checkpoint(arch, model_dir), model_dir)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def copying_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """arch -> (transformers model, checkpoint dir) of a model whose greedy output loops
    (``build_checkpoint(mixer_scale=0.1)``): what n-gram speculation can copy."""
    built: dict[str, tuple[Any, Path]] = {}

    def get(arch: str) -> tuple[Any, Path]:
        if arch not in built:
            model_dir = tmp_path_factory.mktemp(f"copying_{arch}")
            built[arch] = (build_checkpoint(arch, model_dir, mixer_scale=0.1), model_dir)
        return built[arch]

    return get


@pytest.fixture(scope="module")
def llm(checkpoints: Any) -> Any:
    """A fresh ``LLM`` over the tiny Qwen3.5 checkpoint for each test module."""
    from hybridkv import LLM

    _, path = checkpoints(ARCH)
    return LLM(str(path), **OPTIONS)


__all__ = ["ARCHITECTURES"]

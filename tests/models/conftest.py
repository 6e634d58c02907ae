"""Tiny checkpoints built once per session (transformers reference + saved directory)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import make_hf_model, save_checkpoint

from hybridkv.models.loader import LoadedModel, load_model


@pytest.fixture(scope="session", autouse=True)
def _two_threads() -> None:
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    """model_type -> (transformers model, checkpoint dir), built lazily via ``get_tiny``."""
    return {}


@pytest.fixture(scope="session")
def get_tiny(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict) -> Any:
    def get(model_type: str) -> tuple[Any, LoadedModel]:
        if model_type not in tiny_models:
            hf = make_hf_model(model_type)
            path = save_checkpoint(hf, tmp_path_factory.mktemp(model_type))
            tiny_models[model_type] = (hf, load_model(path, "float32"))
        return tiny_models[model_type]

    return get

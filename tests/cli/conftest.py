"""The CLI tests share one tiny Qwen3.5 checkpoint, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.tiny import make_hf_model, save_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(make_hf_model("qwen3_5_text"), tmp_path_factory.mktemp("cli_ckpt"))

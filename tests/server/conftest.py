"""A live server for the whole session: uvicorn on 127.0.0.1 over a tiny Qwen3.5 checkpoint.

The server runs in a background thread of the test process (a real socket, real HTTP), so
tests can also read the engine it wraps. The offline ``LLM`` over the same checkpoint is
the reference the server's token ids are compared with.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))

from server_helpers import ENGINE_OPTIONS, LiveServer, start_server
from tiny import make_hf_model, save_checkpoint

from hybridkv.engine import LLM, EngineConfig, LLMEngine


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> None:
    # Two cores shared by a server thread, client threads and the test: more intra-op
    # threads only oversubscribe them (a step gets 100x slower under load).
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(make_hf_model("qwen3_5_text"), tmp_path_factory.mktemp("serve_ckpt"))


@pytest.fixture(scope="session")
def live(checkpoint: Path) -> Iterator[LiveServer]:
    server = start_server(LLMEngine(EngineConfig(model=str(checkpoint), **ENGINE_OPTIONS)))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def offline(checkpoint: Path) -> LLM:
    """The offline engine over the same checkpoint and options: the reference."""
    return LLM(str(checkpoint), **ENGINE_OPTIONS)


@pytest.fixture
def http(live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.base_url, timeout=60) as client:
        yield client


@pytest.fixture
def client(live: LiveServer) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{live.base_url}/v1", api_key="unused", max_retries=0, timeout=60)

"""The engine: scheduler (continuous batching over the core's CacheManager), model runner,
sampler, stop rules, and the ``LLM`` / ``LLMEngine`` APIs.

Layering: ``scheduler`` and ``request`` are pure Python over ``hybridkv.core``; ``runner``
turns a scheduled step into the model's ForwardBatch and does the state page copies;
``llm_engine`` ties them with sampling and detokenization; ``llm`` is the offline API.

The names below load on first use, so that the torch-free modules (``config``, which every
CLI subcommand reads for its flags, and ``scheduler``, which the simulator runs) never
import torch, and type checkers of those modules do not follow into the torch code.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "EngineConfig": "config",
    "LLM": "llm",
    "LLMEngine": "llm_engine",
    "CompletionOutput": "outputs",
    "Logprob": "outputs",
    "RequestMetrics": "outputs",
    "RequestOutput": "outputs",
    "SamplingParams": "sampling_params",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"hybridkv.engine.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'hybridkv.engine' has no attribute {name!r}")

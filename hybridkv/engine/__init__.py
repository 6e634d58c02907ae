"""The engine: scheduler (continuous batching over the core's CacheManager), model runner,
sampler, stop rules, and the ``LLM`` / ``LLMEngine`` APIs.

Layering: ``scheduler`` and ``request`` are pure Python over ``hybridkv.core``; ``runner``
turns a scheduled step into the model's ForwardBatch and does the state page copies;
``llm_engine`` ties them with sampling and detokenization; ``llm`` is the offline API.

The names below load on first use, so that ``hybridkv.engine.config`` (which every CLI
subcommand reads for its flags) does not import torch for ``hybridkv plan``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridkv.engine.config import EngineConfig
    from hybridkv.engine.llm import LLM
    from hybridkv.engine.llm_engine import LLMEngine
    from hybridkv.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
    from hybridkv.engine.sampling_params import SamplingParams

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


def __getattr__(name: str) -> object:
    if name in _HOMES:
        return getattr(importlib.import_module(f"hybridkv.engine.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'hybridkv.engine' has no attribute {name!r}")

"""The engine: the model runner, sampler, stop rules, and the ``LLM`` / ``LLMEngine`` APIs
over the scheduler of :mod:`hybridkv.sched`.

``inputs`` turns prompts into validated token ids; ``runner`` turns a scheduled step into the
model's ForwardBatch and does the state page copies; ``llm_engine`` ties scheduler, runner,
sampler and detokenization into one step; ``llm`` is the offline API.

The names below load on first use, so that ``config`` (which every CLI subcommand reads for
its flags) never imports torch, and type checkers of it do not follow into the torch code.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "EngineConfig": "hybridkv.engine.config",
    "LLM": "hybridkv.engine.llm",
    "LLMEngine": "hybridkv.engine.llm_engine",
    "CompletionOutput": "hybridkv.engine.outputs",
    "Logprob": "hybridkv.engine.outputs",
    "RequestMetrics": "hybridkv.engine.outputs",
    "RequestOutput": "hybridkv.engine.outputs",
    "RequestOutputKind": "hybridkv.sched.sampling_params",
    "SamplingParams": "hybridkv.sched.sampling_params",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'hybridkv.engine' has no attribute {name!r}")

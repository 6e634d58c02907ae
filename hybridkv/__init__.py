"""hybridkv: a serving engine for hybrid (attention + recurrent) LLMs.

Packages, bottom to top (imports only point down this list):

- ``core``: the pure-Python memory manager (specs, arena, page pools, prefix cache,
  coordinator, planner) shared by the engine, the planner and the simulator.
- ``sim``: a trace-driven simulator that drives ``core`` at real model scale.
- ``ops``: a plain-torch reference for every op, plus optional fast paths.
- ``layers``: torch modules (attention over pages, Mamba, Gated DeltaNet, short conv).
- ``models``: one file per architecture family, loading Hugging Face checkpoints.
- ``engine``: scheduler, runner, sampler and the ``LLM`` API.
- ``server``: the OpenAI-compatible HTTP server. ``cli`` parses arguments and calls down.
"""

import importlib
from typing import Any

__version__ = "0.1.0"

_ENGINE_NAMES = ("LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput")


def __getattr__(name: str) -> Any:
    """``from hybridkv import LLM`` without importing torch for users of the core alone."""
    if name in _ENGINE_NAMES:
        # importlib, not an import statement: type checkers of the torch-free core must not
        # follow it into the engine.
        engine = importlib.import_module("hybridkv.engine")
        return getattr(engine, name)
    raise AttributeError(f"module 'hybridkv' has no attribute {name!r}")

"""hybridkv: a serving engine for hybrid (attention + recurrent) LLMs.

Packages, bottom to top (imports only point down this list; tests/test_layering.py checks):

- ``core``: the pure-Python memory manager (specs, arena, page pools, prefix cache,
  coordinator, planner) shared by the engine, the planner and the simulator.
- ``sched``: the pure-Python scheduler (sampling params, sequences, continuous batching).
- ``sim``: a trace-driven simulator: the scheduler and the core with a GPU cost model.
- ``ops``: a plain-torch reference for every op, plus the paged varlen drivers.
- ``forward``: the engine/model contract (``ForwardBatch``, ``CacheViews``).
- ``layers``: torch modules (attention over pages, Mamba, Gated DeltaNet, short conv).
- ``models``: one file per architecture family, loading Hugging Face checkpoints.
- ``engine``: ``LLMEngine`` and ``LLM``: inputs, runner, sampler, stop rules.
- ``server``: the OpenAI-compatible HTTP server.
- ``bench``, ``demo``: engine workloads; the demo model shipped in the package and its recipe.
- ``cli``: parses arguments and calls down.
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

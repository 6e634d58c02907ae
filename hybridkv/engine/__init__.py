"""The engine: scheduler (continuous batching over the core's CacheManager), model runner,
sampler, stop rules, and the ``LLM`` / ``LLMEngine`` APIs.

Layering: ``scheduler`` and ``request`` are pure Python over ``hybridkv.core``; ``runner``
turns a scheduled step into the model's ForwardBatch and does the state page copies;
``llm_engine`` ties them with sampling and detokenization; ``llm`` is the offline API.
"""

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.llm import LLM
from hybridkv.engine.llm_engine import LLMEngine
from hybridkv.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from hybridkv.engine.sampling_params import SamplingParams

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

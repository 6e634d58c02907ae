"""Scheduling, torch-free and model-free: which sequences run each step, and how far.

- ``sampling_params``: what a request asks for (vLLM's ``SamplingParams``), validated.
- ``request``: one sequence (one completion of a prompt) and its token state.
- ``scheduler``: continuous batching over :class:`~hybridkv.core.manager.CacheManager`.

The engine runs this scheduler with a model; the simulator runs the same one with a cost
model, which is why their prefix-cache hits agree.
"""

"""Workloads replayed on the real engine (``hybridkv bench``): the simulator's traces run
with a model, follow-up turns carrying the engine's own replies."""

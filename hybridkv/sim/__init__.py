"""Trace-driven simulator: replays serving traces on the real ``hybridkv.core`` at model scale.

No torch and no model: a simulated scheduler drives :class:`~hybridkv.core.manager.CacheManager`
exactly as the engine does, and a GPU cost model turns each step into seconds. See
docs/simulator.md for the designs it compares and what the cost model assumes.

- ``traces``: the trace file format (load, validate, save).
- ``workloads``: seeded generators (multi-turn chat, agentic sessions, system prompts).
- ``gpus``, ``cost``: GPU peaks and the per-step cost model.
- ``loop``: the serving loop (the engine's scheduler, no model) and its result record.
- ``designs``: cache designs as configurations of the core.
- ``compare``: run designs side by side.
"""

from hybridkv.sim.compare import SimSetup, compare, make_setup, run_design
from hybridkv.sim.loop import SimConfig, SimResult, Simulator
from hybridkv.sim.traces import Trace, TraceError, TraceRequest, load_trace, save_trace
from hybridkv.sim.workloads import builtin_trace

__all__ = [
    "SimConfig",
    "SimResult",
    "SimSetup",
    "Simulator",
    "Trace",
    "TraceError",
    "TraceRequest",
    "builtin_trace",
    "compare",
    "load_trace",
    "make_setup",
    "run_design",
    "save_trace",
]

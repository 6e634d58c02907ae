"""Run several designs on one trace in one memory budget (or a sweep of budgets)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hybridkv.core.manager import CacheManager
from hybridkv.core.model_config import load_config_dict, model_spec_from_config
from hybridkv.core.spec import ModelSpec
from hybridkv.sim.cost import CostModel, CostParams, model_cost
from hybridkv.sim.designs import DESIGNS, cache_config
from hybridkv.sim.gpus import get_gpu
from hybridkv.sim.loop import SimConfig, SimResult, Simulator
from hybridkv.sim.traces import Trace

SWEEP_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)  # budgets of a sweep, relative to the given one


@dataclass(frozen=True, kw_only=True)
class SimSetup:
    """Everything but the design and the budget: model, GPU, scheduler knobs (SimConfig)."""

    model: ModelSpec
    cost: CostModel
    loop: SimConfig


def make_setup(
    model: str,
    gpu: str = "H100",
    loop: SimConfig | None = None,
    cost_params: CostParams | None = None,
) -> SimSetup:
    """Load a model by built-in name or config path and pick the GPU.

    Raises:
        ValueError: unknown model or GPU, or a config the cost model cannot size.
    """
    name, raw = load_config_dict(model)
    spec = model_spec_from_config(raw, name=name)
    cost = CostModel(model_cost(raw, spec), get_gpu(gpu), cost_params)
    return SimSetup(model=spec, cost=cost, loop=loop or SimConfig())


def run_design(
    setup: SimSetup,
    trace: Trace,
    design: str,
    memory_bytes: int,
    on_request_done: Callable[[], None] | None = None,
) -> SimResult:
    """Replay ``trace`` under one design.

    Raises:
        ValueError: unknown design, or a budget the design cannot lay out.
    """
    config = cache_config(design, setup.model, memory_bytes)
    manager = CacheManager(setup.model, config)
    sim = Simulator(trace, manager, setup.cost, setup.loop, name=design)
    return sim.run(on_request_done)


def check_designs(designs: Sequence[str]) -> list[str]:
    unknown = [d for d in designs if d not in DESIGNS]
    if unknown:
        raise ValueError(f"unknown design {unknown[0]!r} (known: {', '.join(DESIGNS)})")
    if not designs:
        raise ValueError("no design to run")
    return list(dict.fromkeys(designs))


def compare(
    setup: SimSetup,
    trace: Trace,
    memory_bytes: int,
    designs: Sequence[str] = tuple(DESIGNS),
    on_request_done: Callable[[], None] | None = None,
) -> list[SimResult]:
    """Every design on the same trace and budget, in the order given."""
    return [
        run_design(setup, trace, d, memory_bytes, on_request_done) for d in check_designs(designs)
    ]

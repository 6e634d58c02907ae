"""``hybridkv bench --profile``: where a step's time goes, by op and by module.

Runs a workload under ``torch.profiler`` with one named range per module call (forward
hooks on every module of the model but the containers, named by class) and per engine
stage (the step, scheduling, batch building, page copies, the model's decode and prefill
graphs), then prints two tables: ops by self CPU time, and modules and stages by total CPU
time (a module's total includes the modules inside it). A step that runs the model's
graphs (hybridkv.models.decode_graph, prefill_graph) runs no module: its model time is the
graph's stage, one compiled call. Optionally writes a Chrome trace (``chrome://tracing``
or Perfetto).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

if TYPE_CHECKING:
    from hybridkv.engine import LLMEngine

MODULE_PREFIX = "module: "
STAGE_PREFIX = "stage: "
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


@dataclass(frozen=True, slots=True)
class ProfileRow:
    name: str
    calls: int
    self_ms: float
    total_ms: float


@dataclass(frozen=True, slots=True)
class StepProfile:
    """The two tables of a profiled run; times are CPU milliseconds over the whole run."""

    num_steps: int
    ops: list[ProfileRow]  # by self time
    modules: list[ProfileRow]  # modules and engine stages, by total time
    total_ms: float  # all ``engine.step`` calls


def _module_ranges(model: nn.Module) -> list[Any]:
    """Forward hooks that open a profiler range named after each module's class."""
    handles = []
    for module in model.modules():
        if isinstance(module, _CONTAINERS):
            continue
        name = MODULE_PREFIX + type(module).__name__
        stack: list[record_function] = []

        def enter(_m: nn.Module, _args: Any, name: str = name, stack: list = stack) -> None:
            rf = record_function(name)
            rf.__enter__()
            stack.append(rf)

        def leave(_m: nn.Module, _args: Any, _out: Any, stack: list = stack) -> None:
            stack.pop().__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave))
    return handles


def _wrap(obj: Any, attr: str, label: str) -> Callable[[], None]:
    """Run ``obj.attr`` inside a profiler range; returns the undo."""
    original = getattr(obj, attr)

    @functools.wraps(original)
    def ranged(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return original(*args, **kwargs)

    setattr(obj, attr, ranged)  # an instance attribute in front of the class's method

    def undo() -> None:
        delattr(obj, attr)

    return undo


@contextmanager
def profiled(engine: LLMEngine, trace_path: str | None = None) -> Iterator[list[StepProfile]]:
    """Profile everything the engine runs inside the block.

    Yields a list that holds the :class:`StepProfile` once the block has ended.
    """
    result: list[StepProfile] = []
    handles = _module_ranges(engine.runner.model)
    undo = [
        _wrap(engine, "step", STAGE_PREFIX + "engine.step"),
        _wrap(engine.scheduler, "schedule", STAGE_PREFIX + "scheduler.schedule"),
        _wrap(engine.runner, "build_batch", STAGE_PREFIX + "runner.build_batch"),
        _wrap(engine.runner, "copy_pages", STAGE_PREFIX + "runner.copy_pages"),
    ]
    for graph in ("decode_graph", "prefill_graph"):
        loaded = getattr(engine.runner, graph)
        if loaded is not None:
            undo.append(_wrap(loaded, "run", f"{STAGE_PREFIX}runner.{graph}"))
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            yield result
    finally:
        for handle in handles:
            handle.remove()
        for fn in undo:
            fn()
    if trace_path:
        prof.export_chrome_trace(trace_path)
    result.append(_tables(prof))


def _tables(prof: profile) -> StepProfile:
    ops, modules = [], []
    total_ms, num_steps = 0.0, 0
    for event in prof.key_averages():
        row = ProfileRow(
            name=event.key,
            calls=int(event.count),
            self_ms=event.self_cpu_time_total / 1000,
            total_ms=event.cpu_time_total / 1000,
        )
        if event.key == STAGE_PREFIX + "engine.step":
            total_ms, num_steps = row.total_ms, row.calls
        if event.key.startswith((MODULE_PREFIX, STAGE_PREFIX)):
            modules.append(row)
        else:
            ops.append(row)
    ops.sort(key=lambda r: r.self_ms, reverse=True)
    modules.sort(key=lambda r: r.total_ms, reverse=True)
    return StepProfile(num_steps=num_steps, ops=ops, modules=modules, total_ms=total_ms)


def format_profile(p: StepProfile, rows: int = 15) -> str:
    """Both tables as text, the ``rows`` biggest entries of each."""
    per_step = p.total_ms / max(p.num_steps, 1)
    lines = [
        f"profile: {p.num_steps} engine steps, {p.total_ms / 1000:.2f} s CPU in engine.step "
        f"({per_step:.1f} ms per step; torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s))",
    ]
    for title, table, key in (
        ("by module and engine stage (total CPU, nested ranges included)", p.modules, "total"),
        ("by op (self CPU)", p.ops, "self"),
    ):
        lines.append(f"\n{title}")
        lines.append(
            f"  {'name':58s} {'calls':>7s} {'ms':>10s} {'% of steps':>10s} {'ms/step':>8s}"
        )
        for row in table[:rows]:
            ms = row.total_ms if key == "total" else row.self_ms
            share = ms / p.total_ms if p.total_ms else 0.0
            lines.append(
                f"  {row.name[:58]:58s} {row.calls:7d} {ms:10.1f} {share:10.1%} "
                f"{ms / max(p.num_steps, 1):8.2f}"
            )
    return "\n".join(lines)

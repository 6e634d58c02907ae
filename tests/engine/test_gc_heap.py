"""The engine freezes its start-up heap (engine/gc_heap.py) and is still freed when dropped."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
from engine_checkpoints import ARCH, OPTIONS

from hybridkv import LLM, SamplingParams
from hybridkv.engine import llm_engine


def test_startup_heap_is_frozen(checkpoints: Any) -> None:
    """A full collection while serving does not walk the engine built before it."""
    _, path = checkpoints(ARCH)
    llm = LLM(str(path), **OPTIONS)
    assert gc.get_freeze_count() > 0
    for obj in (llm.engine, llm.engine.runner, llm.engine.manager, llm.engine.scheduler):
        assert not any(tracked is obj for tracked in gc.get_objects())


def test_dropped_engine_is_freed_by_reference_counting(checkpoints: Any) -> None:
    """A frozen reference cycle is never collected: the engine, after serving, keeps none
    around itself, so dropping the last reference frees it and its cache arena at once."""
    _, path = checkpoints(ARCH)
    llm = LLM(str(path), **OPTIONS)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8] * 9}] * 3, params)
    assert all(len(out.outputs[0].token_ids) == 6 for out in outs)
    engine = weakref.ref(llm.engine)
    arena = weakref.ref(llm.engine.runner.arena)
    gc.disable()  # only reference counting may free them
    try:
        del llm, outs
        assert engine() is None
        assert arena() is None
    finally:
        gc.enable()


def test_no_collection_runs_during_start_up(
    checkpoints: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The collector is off while the engine starts (loading, compiling: each full
    collection there walks everything start-up made so far) and back on once it serves,
    its start-up garbage collected; a collector the caller turned off stays off, and one
    on comes back on when start-up fails."""
    _, path = checkpoints(ARCH)
    seen: list[bool] = []
    real_load = llm_engine.load_model

    def load_model(*args: Any, **kwargs: Any) -> Any:
        seen.append(gc.isenabled())
        return real_load(*args, **kwargs)

    monkeypatch.setattr(llm_engine, "load_model", load_model)
    LLM(str(path), **OPTIONS)
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        LLM(str(path), **OPTIONS)
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(str(path), max_model_len=128, gpu_memory_utilization=1e-12)
    assert gc.isenabled() and seen[-1] is False

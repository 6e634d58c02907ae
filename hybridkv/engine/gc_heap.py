"""Keep Python's cyclic garbage collector off the start-up heap while the engine serves.

By the time an engine has loaded its model and compiled its ops, the process holds some
400,000 objects the garbage collector tracks (torch, transformers, dynamo's and inductor's
caches, the engine's own), and nearly all of them live as long as the process. A collection
of the oldest generation walks every one of them: 200-230 ms on this machine (the tests'
tiny Qwen3.5 engine, one thread). Serving triggers such collections now and then (Python
runs one once enough new objects have survived), and each stalls the step it lands in: one
203-231 ms stall in each 12-16 s replay of 20 multi-turn chats on one engine (6,718
steps), and in a process that builds engine after engine (the benchmarks, the tests) one
in most runs, added to whichever request's first token was due.

So at the end of start-up the engine collects once and freezes what is left
(:func:`gc.freeze`): those objects move to a permanent generation that collections skip,
and a later full collection walks only what was created since (0.01 ms right after the
freeze). vLLM's engine does the same after its start-up. Reference counting still frees
frozen objects the moment they become unreachable, so an engine that is dropped is freed
as before (tested); only a reference cycle among frozen objects would outlive its last
reference, which is why the collection runs first and why the engine keeps no cycle around
itself (tested too). The first freeze in a process pays the one full collection (0.2-0.4
s of start-up here); later engines' collections find the start-up heap already frozen. The freeze is
process-wide: an application that builds an engine in its own process has its objects of
that moment frozen too, and a reference cycle among them that it drops later stays in
memory (vLLM's in-process engine makes the same trade).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)


@contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection inside the block: the engine's start-up, which
    :func:`freeze_startup_heap` ends with one collection.

    Start-up creates most of those 400,000 objects, and each full collection it triggers
    walks all that exist by then: with the imports of dynamo and inductor moved from
    hybridkv's import to the first compile (hybridkv.ops.compiled), which runs after the
    model is loaded, the small Qwen3-Next's engine took 5.4-7.8 s to build instead of
    3.7-4.4 s on the 2-core AVX2 EPYC of 2026-11-26 (benchmarks/startup_time.py); with
    collections paused around the compile alone 4.5-5.2 s, and around the whole start-up
    (as here) 5.1-5.4 s, of which the final collection 0.35 s (/tmp scripts, 3 runs each).
    What start-up leaves unreachable (dynamo's trace is full of reference cycles) waits
    for that one collection at its end. A collector the caller had disabled stays so."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def freeze_startup_heap() -> None:
    """Collect garbage once, then freeze every tracked object (module doc)."""
    start = time.perf_counter()
    unreachable = gc.collect()
    gc.freeze()
    logger.debug(
        "garbage collector: %d unreachable objects freed, %d frozen in %.1f ms",
        unreachable,
        gc.get_freeze_count(),
        (time.perf_counter() - start) * 1e3,
    )

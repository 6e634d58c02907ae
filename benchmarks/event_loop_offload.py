"""How long an asyncio event loop stalls while a 4 MB prompt is tokenized off the loop.

A 1 ms ticker runs on the loop (as ``/health`` would) while one prompt is tokenized by:

- ``thread encode``: ``asyncio.to_thread(tokenizer.encode)`` (the tokenizers library holds
  the GIL for the whole call);
- ``thread encode_batch``: the same with ``encode_batch([text])``, which lets go of the GIL
  while it tokenizes (what ``hybridkv.models.tokenizer.Tokenizer.encode`` calls);
- ``process pool``: a worker process (spawned, tokenizer loaded once) returns the ids as
  bytes, so the loop's process never builds the tokenizer's Encoding objects.

Prints the longest and the p99 gap between ticks (a gap of 1 ms is no stall) and the wall
time of the tokenization, medians over ``--repeats`` interleaved runs. Run:
``python benchmarks/event_loop_offload.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from array import array
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))

_WORKER: Tokenizer | None = None


def _load(path: str) -> None:
    global _WORKER
    _WORKER = Tokenizer.from_file(path)


def _encode_to_bytes(text: str) -> bytes:
    assert _WORKER is not None
    [encoding] = _WORKER.encode_batch([text])
    return array("i", encoding.ids).tobytes()


def tokenizer_file(cache_dir: Path) -> Path:
    """The grammar benchmark's 150k-token BPE (trained once, locally, then cached)."""
    from grammar_backends import build_tokenizer

    build_tokenizer(150_000, cache_dir)
    return cache_dir / "bpe_150000.json"


async def ticker(stop: asyncio.Event, gaps: list[float]) -> None:
    last = time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


async def run_one(how: str, tok: Tokenizer, pool: ProcessPoolExecutor, text: str) -> Any:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    gaps: list[float] = []
    tick = asyncio.create_task(ticker(stop, gaps))
    await asyncio.sleep(0.05)
    started = time.perf_counter()
    if how == "thread encode":
        num = len((await asyncio.to_thread(tok.encode, text)).ids)
    elif how == "thread encode_batch":
        num = len(await asyncio.to_thread(lambda: tok.encode_batch([text])[0].ids))
    else:
        data = await loop.run_in_executor(pool, _encode_to_bytes, text)
        num = len(array("i", data))
    seconds = time.perf_counter() - started
    await asyncio.sleep(0.05)
    stop.set()
    await tick
    gaps.sort()
    return max(gaps), gaps[int(len(gaps) * 0.99)], seconds, num


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--megabytes", type=float, default=4.0)
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/hybridkv_bench_tokenizers"))
    args = parser.parse_args(argv)
    path = tokenizer_file(args.cache_dir)
    tok = Tokenizer.from_file(str(path))
    words = Path(__file__).read_text().split()
    text = " ".join(words * (int(args.megabytes * 1e6) // len(" ".join(words)) + 1))
    text = text[: int(args.megabytes * 1e6)]
    hows = ["thread encode", "thread encode_batch", "process pool"]
    results: dict[str, list[Any]] = {h: [] for h in hows}
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        1, mp_context=context, initializer=_load, initargs=(str(path),)
    ) as pool:
        pool.submit(len, "warm up").result()
        for r in range(args.repeats):
            for how in hows[r % 3 :] + hows[: r % 3]:
                results[how].append(asyncio.run(run_one(how, tok, pool, text)))
    print(f"{len(text) / 1e6:.1f} MB prompt, 150k-token BPE; medians of {args.repeats} runs")
    print(f"  {'how':22} {'max stall ms':>13} {'p99 gap ms':>11} {'tokenize s':>11} {'tokens':>9}")
    for how, runs in results.items():
        stall, p99, seconds, num = (statistics.median(r[i] for r in runs) for i in range(4))
        print(f"  {how:22} {stall * 1e3:13.1f} {p99 * 1e3:11.1f} {seconds:11.2f} {num:9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

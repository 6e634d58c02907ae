"""Multi-turn chat on the engine: prefix hit rate and time to first token, caching on vs off.

The workload is the simulator's chat trace (:mod:`hybridkv.sim.workloads`) behind one
shared system prompt, sized for a CPU; each follow-up = previous prompt + the engine's
reply + a new message, submitted when the previous turn has finished (the replay of
``hybridkv bench``). It runs on a tiny random Qwen3.5 checkpoint under a grid of cache
settings: eviction LRU vs cost-aware, checkpoint interval and retention interval, once
with a roomy cache and once with one so small that eviction (and preemption) happens.

Every run is on a fresh engine (nothing cached from an earlier run). The repeats go round
the whole grid, each round in a rotated order, so a change in the machine's load hits every
setting alike; each timed figure is the median over the rounds with its min-max, and the
ratio to caching off is taken per round (same round, side by side), then its median.

Printed per setting: the token hit rate (prefix-cache hits / tokens looked up); mean time
to first token (median [min-max] over rounds) and its ratio to caching off; the same
ratio for first turns only (fresh prompts: only the shared system prompt can hit) and for
follow-ups; then the load-independent columns: mean steps from submission to first token
(all requests, and first turns alone), prompt tokens computed (looked up but not hit, so
recomputation after preemption counts), prompt tokens served from the cache,
preemptions and evicted pages (these must not vary between rounds: a "~" marks one that
did), output tokens/s (median), and whether the greedy replies equal those with caching
off (they must: the cache never changes an answer).

Usage: ``python benchmarks/engine_multiturn.py [--conversations 8] [--repeats 5]
[--settings 1 3]`` (indices into ``SETTINGS``; caching off always runs).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from engine_common import build_tiny_checkpoint, machine_line

from hybridkv.bench.workloads import (
    BenchRequest,
    BenchResult,
    requests_from_trace,
    run_workload,
    warm_up,
)
from hybridkv.engine import EngineConfig, LLMEngine
from hybridkv.sim.workloads import ChatWorkload, LengthDist, chat_trace


@dataclass(frozen=True)
class Setting:
    label: str
    options: dict[str, Any]


SETTINGS = [
    Setting("caching off", {"enable_prefix_caching": False}),
    Setting("LRU (engine default)", {}),
    Setting("cost-aware", {"eviction": "cost"}),
    Setting("LRU, checkpoint 64", {"checkpoint_interval": 64}),
    Setting("cost, checkpoint 64", {"eviction": "cost", "checkpoint_interval": 64}),
    Setting("LRU, checkpoint 32", {"checkpoint_interval": 32}),
    Setting("LRU, ckpt 32, retain 128", {"checkpoint_interval": 32, "retention_interval": 128}),
    Setting("LRU, retain 64", {"retention_interval": 64}),
]


def run_once(
    model: str, memory_gib: float, setting: Setting, requests: list[BenchRequest]
) -> BenchResult:
    config = EngineConfig(model=model, cache_memory_gib=memory_gib, **setting.options)
    engine = LLMEngine(config)
    warm_up(engine, engine.vocab_size)
    return run_workload(engine, requests)


def run_grid(
    model: str,
    memory_gib: float,
    requests: list[BenchRequest],
    repeats: int,
    settings: list[Setting],
) -> dict[str, list[BenchResult]]:
    """Every setting's runs, one per round, on a fresh engine each time.

    Round ``i`` starts at setting ``i mod n`` (rotated order), so no setting always runs
    first or right after the same neighbour.
    """
    runs: dict[str, list[BenchResult]] = {s.label: [] for s in settings}
    for i in range(repeats):
        shift = i % len(settings)
        for s in settings[shift:] + settings[:shift]:
            runs[s.label].append(run_once(model, memory_gib, s, requests))
    return runs


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    """'median [min-max]' of ``values``."""
    return (
        f"{fmt.format(statistics.median(values))} "
        f"[{fmt.format(min(values))}-{fmt.format(max(values))}]"
    )


def mean_of(values: dict[str, float] | dict[str, int], ids: set[str]) -> float:
    picked = [v for k, v in values.items() if k in ids]
    return sum(picked) / len(picked) if picked else 0.0


def same_in_every_run(values: list[Any], fmt: str) -> str:
    """The value, or its median marked '~' if the rounds did not all agree."""
    if all(v == values[0] for v in values):
        return fmt.format(values[0])
    return "~" + fmt.format(statistics.median(values))


def print_table(title: str, runs: dict[str, list[BenchResult]], first_turns: set[str]) -> None:
    base = runs["caching off"]
    rounds = len(base)
    print(f"\n{title} ({rounds} rounds; times: median [min-max]; ratios per round)")
    print(
        f"  {'setting':26s} {'hits':>6s} {'TTFT mean ms':>18s} {'TTFT vs off':>17s} "
        f"{'1st turns vs off':>17s} {'follow-ups vs off':>17s} "
        f"{'steps':>5s} {'1st':>4s} {'computed':>8s} {'cached':>7s} {'preempt':>7s} "
        f"{'evicted':>7s} {'out tok/s':>9s}  replies"
    )
    follow_ups = set(base[0].ttft_s) - first_turns
    for label, rs in runs.items():
        same = all(r.replies == base[0].replies for r in rs)
        ratio = [r.ttft_mean_s / b.ttft_mean_s for r, b in zip(rs, base, strict=True)]
        first = [
            mean_of(r.ttft_s, first_turns) / mean_of(b.ttft_s, first_turns)
            for r, b in zip(rs, base, strict=True)
        ]
        later = [
            mean_of(r.ttft_s, follow_ups) / mean_of(b.ttft_s, follow_ups)
            for r, b in zip(rs, base, strict=True)
        ]
        first_steps = [mean_of(dict(r.ttft_steps), first_turns) for r in rs]
        computed = [r.prefix_cache_queries - r.prefix_cache_hits for r in rs]  # recomputation too
        print(
            f"  {label:26s} {statistics.median(r.prefix_cache_hit_rate for r in rs):6.1%} "
            f"{spread([1000 * r.ttft_mean_s for r in rs], '{:.1f}'):>18s} "
            f"{spread(ratio):>17s} {spread(first):>17s} {spread(later):>17s} "
            f"{same_in_every_run([r.ttft_mean_steps for r in rs], '{:.2f}'):>5s} "
            f"{same_in_every_run(first_steps, '{:.2f}'):>4s} "
            f"{same_in_every_run(computed, '{:d}'):>8s} "
            f"{same_in_every_run([r.cached_prompt_tokens for r in rs], '{:d}'):>7s} "
            f"{same_in_every_run([r.num_preemptions for r in rs], '{:d}'):>7s} "
            f"{same_in_every_run([r.pages_evicted for r in rs], '{:d}'):>7s} "
            f"{statistics.median(r.output_tokens_per_s for r in rs):9.1f}  "
            f"{'= off' if same else 'DIFFER'}"
        )


def chat_requests(args: argparse.Namespace, vocab_size: int) -> list[BenchRequest]:
    """Conversations behind one shared system prompt, sized so that prefill time matters."""
    trace = chat_trace(
        ChatWorkload(
            num_conversations=args.conversations,
            turns=args.turns,
            system_prompt_tokens=args.system_tokens,
            user=LengthDist(mean_tokens=96, sigma=0.5, max_tokens=256),
            reply=LengthDist(mean_tokens=48, sigma=0.5, min_tokens=8, max_tokens=128),
            mean_gap_steps=6,
            mean_think_steps=10,
            vocab_size=vocab_size,
            seed=args.seed,
        )
    )
    return requests_from_trace(trace)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=300, help="shared system prompt")
    parser.add_argument("--memory-gib", type=float, default=0.25, help="the roomy cache")
    parser.add_argument("--small-memory-gib", type=float, default=0.003, help="the tight cache")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument(
        "--hidden-size",
        type=int,
        default=64,
        help="the tiny model's hidden size (MLP 1.5x); 64: the tests' model",
    )
    parser.add_argument("--repeats", type=int, default=5, help="rounds over the grid")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--settings",
        nargs="+",
        type=int,
        help="indices into the grid (0 = caching off, always run: the baseline); default all",
    )
    args = parser.parse_args()
    picked = sorted({0, *args.settings}) if args.settings else range(len(SETTINGS))
    settings = [SETTINGS[i] for i in picked]
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        scale = args.hidden_size / 64  # the tests' model: hidden 64, MLP 96
        overrides = {"hidden_size": args.hidden_size, "intermediate_size": round(96 * scale)}
        hf_model, path = build_tiny_checkpoint(Path(tmp), **overrides)
        requests = chat_requests(args, int(hf_model.config.vocab_size))
        del hf_model
        print(f"machine: {machine_line()}")
        print(f"model: tiny Qwen3.5, hidden {args.hidden_size}")
        print(
            f"chat: {args.conversations} conversations x {args.turns} turns behind a "
            f"{args.system_tokens}-token system prompt, ~96-token messages, ~48-token greedy "
            f"replies; {args.repeats} interleaved rounds"
        )
        first_turns = {r.req_id for r in requests if r.after is None}
        for memory_gib in (args.memory_gib, args.small_memory_gib):
            runs = run_grid(str(path), memory_gib, requests, args.repeats, settings)
            print_table(f"cache {memory_gib:g} GiB", runs, first_turns)


if __name__ == "__main__":
    main()

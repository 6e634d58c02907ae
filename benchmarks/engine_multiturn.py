"""Multi-turn chat on the engine: prefix hit rate and time to first token, caching on vs off.

The workload is the simulator's chat trace (:mod:`hybridkv.sim.workloads`) behind one
shared system prompt, sized for a CPU; each follow-up = previous prompt + the engine's
reply + a new message, submitted when the previous turn has finished (the replay of
``hybridkv bench``). It runs on a tiny random Qwen3.5 checkpoint under a grid of cache
settings: eviction LRU vs cost-aware, checkpoint interval and retention interval, once
with a roomy cache and once with one so small that eviction (and preemption) happens.

Printed per setting: the token hit rate (prefix-cache hits / tokens looked up), mean and
p95 time to first token, its ratio to caching off measured in the same run, the mean
steps from submission to first token (load-independent, as the next column is), output
tokens/s, prompt tokens computed (looked up but not hit, so recomputation after
preemption counts: the cost that does not depend on machine load), preemptions, evicted
pages, and whether the greedy replies equal those with caching off (they must: the cache
never changes an answer).

Usage: ``python benchmarks/engine_multiturn.py [--conversations 8] [--repeats 2]
[--settings 1 3]`` (indices into ``SETTINGS``; caching off always runs).
"""

from __future__ import annotations

import argparse
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
) -> dict[str, BenchResult]:
    """Each setting's run with the lowest mean TTFT, on a fresh engine each time.

    The repeats go round the whole grid (not setting by setting), so a change in the
    machine's load during the run hits every setting alike.
    """
    best: dict[str, BenchResult] = {}
    for _ in range(repeats):
        for s in settings:
            r = run_once(model, memory_gib, s, requests)
            if s.label not in best or r.ttft_mean_s < best[s.label].ttft_mean_s:
                best[s.label] = r
    return best


def print_table(title: str, results: dict[str, BenchResult]) -> None:
    base = results["caching off"]
    print(f"\n{title}")
    print(
        f"  {'setting':26s} {'hit rate':>8s} {'TTFT mean':>10s} {'p95':>8s} {'vs off':>7s} "
        f"{'steps':>5s} "
        f"{'out tok/s':>9s} {'computed':>8s} {'preempt':>7s} {'evicted':>7s}  replies"
    )
    for label, r in results.items():
        same = "= off" if r.replies == base.replies else "DIFFER"
        computed = r.prefix_cache_queries - r.prefix_cache_hits  # recomputation included
        print(
            f"  {label:26s} {r.prefix_cache_hit_rate:8.1%} {1000 * r.ttft_mean_s:8.1f}ms "
            f"{1000 * r.ttft_p95_s:6.0f}ms {r.ttft_mean_s / base.ttft_mean_s:7.2f} "
            f"{r.ttft_mean_steps:5.2f} "
            f"{r.output_tokens_per_s:9.1f} {computed:8d} {r.num_preemptions:7d} "
            f"{r.pages_evicted:7d}  {same}"
        )
    cached = {k: v for k, v in results.items() if k != "caching off"}
    best_ttft = min(cached, key=lambda k: cached[k].ttft_mean_s)
    best_hits = max(cached, key=lambda k: cached[k].prefix_cache_hit_rate)
    print(f"  best mean TTFT: {best_ttft}; best hit rate: {best_hits}")


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
    parser.add_argument("--repeats", type=int, default=2, help="runs per setting (best kept)")
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
        hf_model, path = build_tiny_checkpoint(Path(tmp))
        requests = chat_requests(args, int(hf_model.config.vocab_size))
        del hf_model
        print(f"machine: {machine_line()}")
        print(
            f"chat: {args.conversations} conversations x {args.turns} turns behind a "
            f"{args.system_tokens}-token system prompt, ~96-token messages, ~48-token greedy "
            f"replies; best of {args.repeats} runs per setting"
        )
        for memory_gib in (args.memory_gib, args.small_memory_gib):
            results = run_grid(str(path), memory_gib, requests, args.repeats, settings)
            print_table(f"cache {memory_gib:g} GiB", results)


if __name__ == "__main__":
    main()

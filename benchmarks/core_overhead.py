"""Microseconds per scheduler step spent in the memory core, at 256 running requests.

A multi-turn chat trace on a real model config (Qwen3.5-0.8B shapes by default): 256
conversations run at once; each step every running request decodes one token (or
prefills a chunk of its next turn), and the core is asked exactly what a scheduler
asks it: add_request / find_hit / next_split / allocate / commit / free.

Printed: µs per step and per request-step for prefix caching on (LRU and cost-aware)
and, as the baseline measured in the same run, caching off; plus the trace's token
hit rate. Usage: ``python benchmarks/core_overhead.py [--steps 400] [--model NAME]``.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field

from hybridkv.core.checkpoint import CheckpointPolicy
from hybridkv.core.eviction import EvictionPolicy
from hybridkv.core.ids import ReqId
from hybridkv.core.manager import CacheConfig, CacheManager, Hit
from hybridkv.core.model_config import load_model_spec

GIB = 1 << 30


@dataclass
class Conversation:
    """One chat: each turn's prompt is the whole previous sequence plus a new message."""

    conv_id: int
    rng: random.Random
    tokens: list[int] = field(default_factory=list)  # prompt + sampled so far
    prompt_len: int = 0
    computed: int = 0
    remaining_output: int = 0
    turn: int = 0
    req_id: ReqId = field(default_factory=lambda: ReqId(""))
    hit: Hit | None = None

    def start_turn(self, manager: CacheManager) -> None:
        self.tokens += [self.rng.randrange(32_000) for _ in range(self.rng.randint(20, 200))]
        self.prompt_len = len(self.tokens)
        self.remaining_output = self.rng.randint(20, 120)
        self.turn += 1
        self.req_id = ReqId(f"c{self.conv_id}-t{self.turn}")
        manager.add_request(self.req_id, self.tokens)
        self.hit = manager.find_hit(self.req_id)
        self.computed = self.hit.num_tokens

    def step(self, manager: CacheManager, chunk: int) -> None:
        """One scheduler step for this request: a prefill chunk or one decode token."""
        if self.computed < self.prompt_len:
            end = min(self.prompt_len, self.computed + chunk)
            end = manager.next_split(self.req_id, self.computed, end)
        else:
            end = self.computed + 1
        if manager.allocate(self.req_id, end - self.computed, self.hit) is None:
            return  # a real scheduler would preempt; the benchmark sizes memory to avoid it
        self.hit = None
        self.computed = end
        sampled: list[int] = []
        if end >= self.prompt_len:
            sampled = [self.rng.randrange(32_000)]
            self.tokens += sampled
            self.remaining_output -= 1
        manager.commit(self.req_id, end, sampled)
        if self.remaining_output <= 0:
            manager.free(self.req_id)
            self.start_turn(manager)


def run(manager: CacheManager, num_convs: int, num_steps: int, chunk: int, seed: int) -> float:
    """Seconds spent in core calls over ``num_steps`` steps of ``num_convs`` requests."""
    rng = random.Random(seed)
    system = [rng.randrange(32_000) for _ in range(300)]
    convs = [
        Conversation(i, random.Random(seed * 1000 + i), list(system)) for i in range(num_convs)
    ]
    for conv in convs:
        conv.start_turn(manager)
    start = time.perf_counter()
    for _ in range(num_steps):
        for conv in convs:
            conv.step(manager, chunk)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen3.5-0.8b")
    parser.add_argument("--memory-gib", type=float, default=40.0)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--chunk", type=int, default=256)
    args = parser.parse_args()
    spec = load_model_spec(args.model)
    settings = [
        ("caching off (baseline)", False, EvictionPolicy.LRU),
        ("caching on, LRU", True, EvictionPolicy.LRU),
        ("caching on, cost-aware", True, EvictionPolicy.COST),
    ]
    print(
        f"{args.model}, {args.memory_gib} GiB, {args.requests} running requests, {args.steps} steps"
    )
    baseline = None
    for label, caching, policy in settings:
        config = CacheConfig(
            memory_bytes=int(args.memory_gib * GIB),
            enable_prefix_caching=caching,
            eviction=policy,
            checkpoint=CheckpointPolicy(interval_tokens=512),
        )
        manager = CacheManager(spec, config)
        spent = run(manager, args.requests, args.steps, args.chunk, seed=0)
        req_steps = args.requests * args.steps
        per_step = spent / args.steps * 1e6
        baseline = baseline or per_step
        s = manager.stats
        rate = s.hit_tokens / s.query_tokens if s.query_tokens else 0.0
        print(
            f"{label:24s} {per_step:10.1f} us/step  {spent / req_steps * 1e6:6.2f} us/request-step"
            f"  x{per_step / baseline:.2f} vs baseline  token hit rate {rate:.3f}"
        )


if __name__ == "__main__":
    main()

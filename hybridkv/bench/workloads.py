"""Named workloads replayed on the real engine, for ``hybridkv bench`` and ``benchmarks/``.

The traces come from :mod:`hybridkv.sim.workloads` (the simulator's generators), sized down
so a tiny model on a laptop CPU finishes in seconds, with token ids drawn from the model's
own vocabulary. Each request keeps its arrival step, its turn dependency (``after``) and its
think time, counted in engine steps.

A trace fixes every reply, but the engine writes its own. The sim defines a follow-up turn as
*previous prompt + previous reply + new message*; the replay sends the previous prompt as
the engine saw it + the reply the engine gave + the new message (the tail of the trace's
prompt past the previous prompt and reply). That is what a chat client sends, so the hits
on the previous turn's sequence-end snapshot are the ones a real conversation gets.

Replies run with ``ignore_eos`` and ``max_tokens`` = the trace's reply length, so every
configuration generates the same number of tokens and their timings compare.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from hybridkv.sim.traces import Trace, TraceRequest
from hybridkv.sim.workloads import (
    AgenticWorkload,
    ChatWorkload,
    LengthDist,
    SystemPromptWorkload,
    agentic_trace,
    chat_trace,
    system_prompt_trace,
)

if TYPE_CHECKING:
    from hybridkv.engine import LLMEngine, RequestOutput

WORKLOADS = ("chat", "agentic", "shared-prefix", "repeat")


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchRequest:
    """One request of a replay; a follow-up's prompt is only known once ``after`` finished."""

    req_id: str
    new_token_ids: tuple[int, ...]  # the whole prompt of a first turn; the new message otherwise
    max_tokens: int
    arrival_step: int = 0
    after: str | None = None
    think_steps: int = 0


def requests_from_trace(trace: Trace) -> list[BenchRequest]:
    """The trace's requests with each follow-up reduced to its new message.

    Raises:
        ValueError: a follow-up whose prompt does not start with the previous prompt + reply.
    """
    by_id: dict[str, TraceRequest] = {}
    out: list[BenchRequest] = []
    for r in trace.requests:
        new = r.prompt_token_ids
        if r.after is not None:
            prev = by_id[r.after]
            context = prev.prompt_token_ids + prev.output_token_ids
            if r.prompt_token_ids[: len(context)] != context:
                raise ValueError(f"{r.req_id}: prompt does not extend {r.after}'s prompt + reply")
            new = r.prompt_token_ids[len(context) :]
        by_id[r.req_id] = r
        out.append(
            BenchRequest(
                req_id=r.req_id,
                new_token_ids=new,
                max_tokens=len(r.output_token_ids),
                arrival_step=r.arrival_step,
                after=r.after,
                think_steps=r.think_steps,
            )
        )
    return out


def _repeat_trace(num_requests: int, vocab_size: int, seed: int) -> Trace:
    """A few distinct prompts asked again and again (a FAQ bot, a benchmark loop)."""
    rng = random.Random(seed)
    prompts = [tuple(rng.randrange(vocab_size) for _ in range(128)) for _ in range(4)]
    requests = []
    for i in range(num_requests):
        requests.append(
            TraceRequest(
                req_id=f"r{i}",
                arrival_step=2 * i,
                prompt_token_ids=prompts[i % len(prompts)],
                output_token_ids=tuple(rng.randrange(vocab_size) for _ in range(24)),
            )
        )
    return Trace(requests=tuple(requests), meta={"kind": "repeat", "vocab_size": vocab_size})


def workload_trace(name: str, num_requests: int, vocab_size: int, seed: int = 0) -> Trace:
    """The named workload's trace, cut to ``num_requests`` requests (dependencies stay valid).

    Lengths are the sim's shapes scaled to a CPU: chat turns of ~48 user / ~32 reply tokens,
    agent sessions behind a 384-token shared prefix, four ~256-token system prompts.

    Raises:
        ValueError: an unknown name or ``num_requests`` < 1.
    """
    if num_requests < 1:
        raise ValueError(f"the number of requests must be at least 1, got {num_requests}")
    reply = LengthDist(mean_tokens=32, sigma=0.6, min_tokens=4, max_tokens=96)
    if name == "chat":
        turns = 4
        trace = chat_trace(
            ChatWorkload(
                num_conversations=math.ceil(num_requests / turns),
                turns=turns,
                user=LengthDist(mean_tokens=48, max_tokens=192),
                reply=reply,
                mean_gap_steps=4,
                mean_think_steps=8,
                vocab_size=vocab_size,
                seed=seed,
            )
        )
    elif name == "agentic":
        turns = 6
        trace = agentic_trace(
            AgenticWorkload(
                num_sessions=math.ceil(num_requests / turns),
                turns=turns,
                shared_prefix_tokens=384,
                task=LengthDist(mean_tokens=64, max_tokens=192),
                tool_result=LengthDist(mean_tokens=48, max_tokens=192),
                reply=LengthDist(mean_tokens=24, sigma=0.5, min_tokens=4, max_tokens=64),
                mean_gap_steps=8,
                mean_think_steps=2,
                vocab_size=vocab_size,
                seed=seed,
            )
        )
    elif name == "shared-prefix":
        trace = system_prompt_trace(
            SystemPromptWorkload(
                num_requests=num_requests,
                num_system_prompts=4,
                system=LengthDist(mean_tokens=256, sigma=0.5, max_tokens=768),
                user=LengthDist(mean_tokens=48, max_tokens=192),
                reply=reply,
                mean_gap_steps=2,
                vocab_size=vocab_size,
                seed=seed,
            )
        )
    elif name == "repeat":
        trace = _repeat_trace(num_requests, vocab_size, seed)
    else:
        raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")
    return Trace(requests=trace.requests[:num_requests], meta=trace.meta)


def build_workload(
    name: str, num_requests: int, vocab_size: int, seed: int = 0
) -> list[BenchRequest]:
    """:func:`workload_trace` as replayable requests."""
    return requests_from_trace(workload_trace(name, num_requests, vocab_size, seed))


@dataclass(kw_only=True)
class BenchResult:
    """What one replay measured; rates are over the wall time of the whole replay."""

    num_requests: int
    elapsed_s: float
    num_steps: int  # scheduling rounds (a round of decode bursts is one)
    num_burst_forwards: int  # forwards decode bursts ran past their rounds' first
    prompt_tokens: int
    cached_prompt_tokens: int  # sum of the requests' num_cached_tokens
    output_tokens: int
    output_tokens_per_s: float
    total_tokens_per_s: float
    ttft_mean_s: float
    ttft_p95_s: float
    ttft_mean_steps: float  # engine steps from submission to first token: load-independent
    prefix_cache_queries: int  # tokens looked up (re-admissions after preemption included)
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    pages_evicted: int
    replies: dict[str, list[int]] = field(default_factory=dict, repr=False)
    # per request: seconds and engine steps from submission to first token
    ttft_s: dict[str, float] = field(default_factory=dict, repr=False)
    ttft_steps: dict[str, int] = field(default_factory=dict, repr=False)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for per_request in ("replies", "ttft_s", "ttft_steps"):
            del data[per_request]
        return data


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


class _Replay:
    """Submits requests when their step comes and their previous turn has finished."""

    def __init__(self, engine: LLMEngine, requests: Sequence[BenchRequest]) -> None:
        self.engine = engine
        self.followers: dict[str, list[BenchRequest]] = {}
        self.ready: list[tuple[int, int, BenchRequest, tuple[int, ...]]] = []  # a heap
        for order, r in enumerate(requests):
            if r.after is None:
                self.ready.append((r.arrival_step, order, r, r.new_token_ids))
            else:
                self.followers.setdefault(r.after, []).append(r)
        heapq.heapify(self.ready)
        self.order = len(requests)
        self.step = 0
        self.finished: dict[str, RequestOutput] = {}
        self.submitted_step: dict[str, int] = {}
        self.first_token_step: dict[str, int] = {}

    def submit_due(self, temperature: float) -> None:
        from hybridkv.engine import SamplingParams

        while self.ready and self.ready[0][0] <= self.step:
            _, _, r, prompt = heapq.heappop(self.ready)
            params = SamplingParams(
                max_tokens=r.max_tokens, temperature=temperature, ignore_eos=True
            )
            self.engine.add_request(r.req_id, {"prompt_token_ids": list(prompt)}, params)
            self.submitted_step[r.req_id] = self.step

    def on_output(self, out: RequestOutput) -> None:
        if out.outputs[0].token_ids and out.request_id not in self.first_token_step:
            self.first_token_step[out.request_id] = self.step

    def on_finished(self, out: RequestOutput) -> None:
        if out.error is not None:
            raise RuntimeError(f"request {out.request_id} failed: {out.error}")
        self.finished[out.request_id] = out
        context = (*out.prompt_token_ids, *out.outputs[0].token_ids)
        for r in self.followers.pop(out.request_id, []):
            self.order += 1
            entry = (self.step + r.think_steps, self.order, r, context + r.new_token_ids)
            heapq.heappush(self.ready, entry)


def run_workload(
    engine: LLMEngine,
    requests: Sequence[BenchRequest],
    *,
    temperature: float = 0.0,
    on_finish: Callable[[RequestOutput], None] | None = None,
) -> BenchResult:
    """Replay ``requests`` on ``engine`` to the end; the clock is the engine's step count.

    When the engine is idle and the next arrival lies in the future, the clock jumps to it:
    think time costs steps, never wall time.

    Raises:
        RuntimeError: the engine gave up on a request (e.g. it does not fit in the cache).
    """
    before = engine.stats()
    replay = _Replay(engine, requests)
    start = time.perf_counter()
    while replay.ready or engine.has_unfinished_requests():
        replay.submit_due(temperature)
        if not engine.has_unfinished_requests():
            replay.step = max(replay.step, replay.ready[0][0])
            continue
        outputs = engine.step()
        replay.step += 1
        for out in outputs:
            replay.on_output(out)
            if out.finished:
                replay.on_finished(out)
                if on_finish is not None:
                    on_finish(out)
    elapsed = time.perf_counter() - start
    steps = {i: replay.first_token_step[i] - replay.submitted_step[i] for i in replay.finished}
    return _result(engine, before, replay.finished, elapsed, replay.step, steps)


def _result(
    engine: LLMEngine,
    before: dict[str, Any],
    finished: dict[str, RequestOutput],
    elapsed: float,
    num_steps: int,
    ttft_steps: dict[str, int],
) -> BenchResult:
    after = engine.stats()
    outs = list(finished.values())
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft_by_id = {
        o.request_id: t
        for o in outs
        if o.metrics and (t := o.metrics.time_to_first_token) is not None
    }
    ttfts = list(ttft_by_id.values())
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    elapsed = max(elapsed, 1e-9)
    return BenchResult(
        num_requests=len(outs),
        elapsed_s=elapsed,
        num_steps=num_steps,
        num_burst_forwards=after["num_burst_forwards"] - before["num_burst_forwards"],
        prompt_tokens=prompt_tokens,
        cached_prompt_tokens=sum(o.num_cached_tokens for o in outs),
        output_tokens=output_tokens,
        output_tokens_per_s=output_tokens / elapsed,
        total_tokens_per_s=(prompt_tokens + output_tokens) / elapsed,
        ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else 0.0,
        ttft_p95_s=percentile(ttfts, 95),
        ttft_mean_steps=sum(ttft_steps.values()) / len(ttft_steps) if ttft_steps else 0.0,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        prefix_cache_hit_rate=hits / queries if queries else 0.0,
        num_preemptions=after["num_preemptions"] - before["num_preemptions"],
        pages_evicted=after["pages_evicted"] - before["pages_evicted"],
        replies={o.request_id: list(o.outputs[0].token_ids) for o in outs},
        ttft_s=ttft_by_id,
        ttft_steps=dict(ttft_steps),
    )


def warm_up(engine: LLMEngine, vocab_size: int) -> None:
    """One short request, so one-time costs (allocator, kernels' first call) are not timed."""
    from hybridkv.engine import SamplingParams

    rng = random.Random(12345)
    prompt = [rng.randrange(vocab_size) for _ in range(40)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("warm-up", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        engine.step()

"""Seeded trace generators: multi-turn chat, agentic sessions, shared system prompts.

Lengths are log-normal with a configurable mean (a log-normal fits the long right tail
of real chat logs). Defaults sit near published per-turn statistics: LMSYS-Chat-1M
reports about 70 tokens per user prompt and 215 per response, ShareGPT about 95 and 350
(Zheng et al. 2023, Table 1), so the chat default is 100 / 300. Token ids are random, so
two different messages never share a block by accident; what is shared is exactly what
the workload says is shared.

Every generator is a pure function of its config: the same seed gives the same trace.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from hybridkv.sim.traces import DEFAULT_VOCAB_SIZE, Trace, TraceRequest


@dataclass(frozen=True, kw_only=True, slots=True)
class LengthDist:
    """Log-normal token counts with mean ``mean_tokens``, clipped to [min, max]."""

    mean_tokens: float
    sigma: float = 1.0
    min_tokens: int = 1
    max_tokens: int = 4096

    def sample(self, rng: random.Random) -> int:
        mu = math.log(self.mean_tokens) - self.sigma**2 / 2
        value = round(rng.lognormvariate(mu, self.sigma))
        return min(self.max_tokens, max(self.min_tokens, value))


def _exp_steps(rng: random.Random, mean: float) -> int:
    return round(rng.expovariate(1 / mean)) if mean > 0 else 0


class _Tokens:
    """Fresh random token ids from one seeded stream."""

    def __init__(self, rng: random.Random, vocab_size: int) -> None:
        self.rng = rng
        self.vocab_size = vocab_size

    def take(self, count: int) -> tuple[int, ...]:
        return tuple(self.rng.randrange(self.vocab_size) for _ in range(count))


def _next_turn(
    rng: random.Random,
    req_id: str,
    arrival: int,
    after: str | None,
    mean_think_steps: float,
    prompt: tuple[int, ...],
    output: tuple[int, ...],
) -> TraceRequest:
    """One turn of a session: it waits for ``after`` (the previous turn) and a think time."""
    think = _exp_steps(rng, mean_think_steps) if after else 0
    return TraceRequest(
        req_id=req_id,
        arrival_step=arrival,
        after=after,
        think_steps=think,
        prompt_token_ids=prompt,
        output_token_ids=output,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class ChatWorkload:
    """Conversations of ``turns`` turns; turn k's prompt = turn k-1's prompt + reply + message."""

    num_conversations: int = 48
    turns: int = 6
    system_prompt_tokens: int = 0  # one system prompt shared by every conversation
    user: LengthDist = field(default_factory=lambda: LengthDist(mean_tokens=100))
    reply: LengthDist = field(default_factory=lambda: LengthDist(mean_tokens=300, sigma=0.8))
    mean_gap_steps: float = 20  # between conversation starts (exponential)
    mean_think_steps: float = 200  # user think time after a reply (exponential)
    vocab_size: int = DEFAULT_VOCAB_SIZE
    seed: int = 0


def chat_trace(w: ChatWorkload) -> Trace:
    rng = random.Random(w.seed)
    tokens = _Tokens(random.Random(w.seed + 1), w.vocab_size)
    system = tokens.take(w.system_prompt_tokens)
    requests: list[TraceRequest] = []
    start = 0
    for c in range(w.num_conversations):
        context = system
        after: str | None = None
        for t in range(w.turns):
            prompt = context + tokens.take(w.user.sample(rng))
            output = tokens.take(w.reply.sample(rng))
            turn = _next_turn(rng, f"c{c}-t{t}", start, after, w.mean_think_steps, prompt, output)
            requests.append(turn)
            context, after = prompt + output, turn.req_id
        start += _exp_steps(rng, w.mean_gap_steps)
    return Trace(requests=tuple(requests), meta={"kind": "chat", "vocab_size": w.vocab_size})


@dataclass(frozen=True, kw_only=True, slots=True)
class AgenticWorkload:
    """Agent sessions: a long prefix shared by all (tools, instructions), then many short turns.

    Each turn appends the agent's reply and a tool result to the context.
    """

    num_sessions: int = 16
    turns: int = 16
    shared_prefix_tokens: int = 4000
    task: LengthDist = field(default_factory=lambda: LengthDist(mean_tokens=300))
    tool_result: LengthDist = field(default_factory=lambda: LengthDist(mean_tokens=150))
    reply: LengthDist = field(default_factory=lambda: LengthDist(mean_tokens=80, sigma=0.6))
    mean_gap_steps: float = 50
    mean_think_steps: float = 5  # tool latency
    vocab_size: int = DEFAULT_VOCAB_SIZE
    seed: int = 0


def agentic_trace(w: AgenticWorkload) -> Trace:
    rng = random.Random(w.seed)
    tokens = _Tokens(random.Random(w.seed + 1), w.vocab_size)
    shared = tokens.take(w.shared_prefix_tokens)
    requests: list[TraceRequest] = []
    start = 0
    for s in range(w.num_sessions):
        prompt = shared + tokens.take(w.task.sample(rng))
        after: str | None = None
        for t in range(w.turns):
            output = tokens.take(w.reply.sample(rng))
            turn = _next_turn(rng, f"a{s}-t{t}", start, after, w.mean_think_steps, prompt, output)
            requests.append(turn)
            prompt = prompt + output + tokens.take(w.tool_result.sample(rng))
            after = turn.req_id
        start += _exp_steps(rng, w.mean_gap_steps)
    return Trace(requests=tuple(requests), meta={"kind": "agentic", "vocab_size": w.vocab_size})


@dataclass(frozen=True, kw_only=True, slots=True)
class SystemPromptWorkload:
    """Independent single-turn requests, each behind one of a few shared system prompts."""

    num_requests: int = 200
    num_system_prompts: int = 4
    system: LengthDist = field(default_factory=lambda: LengthDist(mean_tokens=1500, sigma=0.5))
    user: LengthDist = field(default_factory=lambda: LengthDist(mean_tokens=100))
    reply: LengthDist = field(default_factory=lambda: LengthDist(mean_tokens=200, sigma=0.8))
    mean_gap_steps: float = 5
    vocab_size: int = DEFAULT_VOCAB_SIZE
    seed: int = 0


def system_prompt_trace(w: SystemPromptWorkload) -> Trace:
    rng = random.Random(w.seed)
    tokens = _Tokens(random.Random(w.seed + 1), w.vocab_size)
    systems = [tokens.take(w.system.sample(rng)) for _ in range(w.num_system_prompts)]
    requests: list[TraceRequest] = []
    arrival = 0
    for i in range(w.num_requests):
        system = systems[rng.randrange(len(systems))]
        requests.append(
            TraceRequest(
                req_id=f"s{i}",
                arrival_step=arrival,
                prompt_token_ids=system + tokens.take(w.user.sample(rng)),
                output_token_ids=tokens.take(w.reply.sample(rng)),
            )
        )
        arrival += _exp_steps(rng, w.mean_gap_steps)
    return Trace(
        requests=tuple(requests), meta={"kind": "system-prompt", "vocab_size": w.vocab_size}
    )


TRACE_KINDS = ("chat", "agentic", "system-prompt")


def builtin_trace(kind: str, seed: int = 0, scale: float = 1.0) -> Trace:
    """A generated trace by name; ``scale`` multiplies the number of conversations/requests.

    Raises:
        ValueError: an unknown kind.
    """

    def count(n: int) -> int:
        return max(1, round(n * scale))

    if kind == "chat":
        return chat_trace(ChatWorkload(num_conversations=count(48), seed=seed))
    if kind == "agentic":
        return agentic_trace(AgenticWorkload(num_sessions=count(16), seed=seed))
    if kind == "system-prompt":
        return system_prompt_trace(SystemPromptWorkload(num_requests=count(200), seed=seed))
    raise ValueError(f"unknown trace kind {kind!r} (known: {', '.join(TRACE_KINDS)})")

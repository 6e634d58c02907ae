"""``hybridkv demo``: what hybridkv does, in a scripted chat with the shipped demo model.

It prints the startup capacity report (KV capacity over attention groups only, state
slots, the concurrency cap and what binds it) beside what one unified page size would
give, then chats for a few turns. Each turn's prompt is the whole conversation so far,
rendered with the chat template as a chat client sends it, so the previous turn comes
back as a prefix: the recurrent state resumes from the snapshot taken where the last
reply ended. After every turn it prints the prompt tokens served from the prefix cache and
the time to first token with caching on against a second engine with caching off (same
model, same greedy reply).

Timing: one run is at the mercy of machine load, so each turn's first token is timed
``--repeats`` times on each engine, interleaved (on, off, on, ...), and the medians are
printed. Before each caching-on run the prefix cache is reset and the previous turn run
again (``LLMEngine.reset_prefix_cache``), so every run starts from the cache state the turn
found and does the same work; the printout says whether every run found the same cached
prefix. Both engines get the same warm-up request before anything is timed, and the
running totals count the scripted turns only.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple

from hybridkv.cli.common import build_engine, flag_error, write
from hybridkv.cli.engine_args import add_engine_args, model_arg

if TYPE_CHECKING:
    from hybridkv.engine import LLMEngine, RequestOutput, SamplingParams
    from hybridkv.engine.inputs import PromptType

SCRIPT = (
    "Hello!",
    "What color is the sky?",
    "What does a cow say?",
    "What is the capital of France?",
    "Thank you!",
)
SYSTEM_PROMPT = "You are a helpful assistant."


def add_demo_parser(commands: Any) -> None:
    p = commands.add_parser(
        "demo",
        help="chat for a few turns with the shipped demo model, showing capacity and cache reuse",
        description="Print the capacity report of the demo model (shipped in the package), "
        "then run a scripted multi-turn chat, printing after each turn the prompt tokens "
        "served from the prefix cache and the time to first token with caching on and off.",
    )
    add_engine_args(p, model_required=False)
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per reply at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument(
        "--no-compare", action="store_true", help="skip the caching-off engine and its TTFT"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed runs of each turn's first token per engine (the median is printed)",
    )
    p.set_defaults(run=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from hybridkv.engine import LLMEngine, SamplingParams
    from hybridkv.engine.llm import render_chat

    if args.repeats < 1:
        raise flag_error(ValueError(f"--repeats must be >= 1, not {args.repeats}"), args)
    try:
        # a fixed seed when sampling: the replays that restore the cache reproduce each turn
        seed = None if args.temperature == 0 else 0
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=seed)
    except ValueError as exc:
        raise flag_error(exc, args) from None
    start = time.perf_counter()
    if model_arg(args) is None:
        import torch

        # The shipped ~1M-parameter model gains nothing from a second thread, and on a
        # busy machine OpenMP's barriers made every step wait (the demo build's reason too).
        torch.set_num_threads(1)
    logging.getLogger("hybridkv.engine").setLevel(logging.WARNING)  # the report is printed
    engine = build_engine(args)
    tokenizer = engine.tokenizer
    if tokenizer is None or tokenizer.chat_template is None:
        raise ValueError(f"{engine.config.model} has no chat template: the demo needs one")
    engines = [engine]
    baseline = None
    if not args.no_compare:
        baseline = LLMEngine(
            replace(engine.config, enable_prefix_caching=False, mamba_cache_mode=None)
        )
        engines.append(baseline)
    for each in engines:
        warm_up(each, tokenizer, params)
    write(f"model {engine.config.model}: ready in {time.perf_counter() - start:.1f} s\n")
    write("\ncapacity (the numbers `hybridkv plan` prints for these settings):\n")
    write("".join(f"  {line}\n" for line in engine.capacity_report))
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM_PROMPT}]
    totals = dict.fromkeys(COUNTERS, 0)
    previous: PromptType | None = None  # the last turn's prompt: replayed to restore the cache
    for turn, question in enumerate(SCRIPT, start=1):
        messages.append({"role": "user", "content": question})
        prompt: PromptType = {"prompt_token_ids": render_chat(tokenizer, messages)}
        timing = None
        if baseline is not None:
            timing = time_turn(engine, baseline, previous, prompt, params, args.repeats)
            restore_cache(engine, previous, params)
        before = engine.stats()
        write(f"\n[turn {turn}] user: {question}\nassistant: ")
        out = _reply(engine, prompt, params)
        totals = {key: totals[key] + engine.stats()[key] - before[key] for key in COUNTERS}
        messages.append({"role": "assistant", "content": out.outputs[0].text})
        other = None if baseline is None else _reply(baseline, prompt, params, stream=False)
        print_turn_stats(out, other, timing, totals)
        previous = prompt
    return 0


class TurnTiming(NamedTuple):
    """Time to first token of one turn: medians of interleaved repeats, caching on and off."""

    on_ms: float
    off_ms: float
    repeats: int
    cached_tokens: tuple[int, ...]  # prompt tokens each caching-on repeat found cached


def restore_cache(engine: LLMEngine, previous: PromptType | None, params: SamplingParams) -> None:
    """Put the prefix cache back in the state the turn found: empty it, then run the
    previous turn again (the same prompt and reply, so the same snapshots are taken)."""
    engine.reset_prefix_cache()
    if previous is not None:
        _reply(engine, previous, params, stream=False)


def time_turn(
    engine: LLMEngine,
    baseline: LLMEngine,
    previous: PromptType | None,
    prompt: PromptType,
    params: SamplingParams,
    repeats: int,
) -> TurnTiming:
    """The turn's first token, ``repeats`` times on each engine, interleaved (on, off, on,
    ...) so that machine load weighs on both alike; the caching engine's cache is restored
    to the state the turn found before each of its runs, so each does the same work."""
    first_token = replace(params, max_tokens=1)
    on: list[float] = []
    off: list[float] = []
    cached: list[int] = []
    for _ in range(repeats):
        restore_cache(engine, previous, params)
        out = _reply(engine, prompt, first_token, stream=False)
        on.append(_ms(out) or 0.0)
        cached.append(out.num_cached_tokens)
        off.append(_ms(_reply(baseline, prompt, first_token, stream=False)) or 0.0)
    return TurnTiming(statistics.median(on), statistics.median(off), repeats, tuple(cached))


def warm_up(engine: LLMEngine, tokenizer: Any, params: SamplingParams) -> None:
    """Pay the one-time costs (first forward, first pages touched) before any timed turn.

    Every engine whose time to first token is printed gets the same warm-up, so caching
    on and off are compared on equal terms (warming only one made caching look slower).
    """
    from hybridkv.engine.llm import render_chat

    prompt = render_chat(tokenizer, [{"role": "user", "content": "Hi"}])
    _reply(engine, {"prompt_token_ids": prompt}, replace(params, max_tokens=1), stream=False)


COUNTERS = (
    "prefix_cache_hits",
    "prefix_cache_queries",
    "state_snapshots_taken",
    "prefix_cache_hybrid_misses",
)


def _reply(
    engine: LLMEngine, prompt: PromptType, params: SamplingParams, stream: bool = True
) -> RequestOutput:
    from hybridkv.cli.generate import stream_completions

    (out,) = stream_completions(engine, [prompt], params, write if stream else _discard)
    return out


def _discard(text: str) -> None:
    pass


def _ms(out: RequestOutput | None) -> float | None:
    if out is None or out.metrics is None or out.metrics.time_to_first_token is None:
        return None
    return 1000 * out.metrics.time_to_first_token


def print_turn_stats(
    out: RequestOutput,
    without: RequestOutput | None,
    timing: TurnTiming | None,
    totals: dict[str, int],
) -> None:
    """Per turn: this prompt's cached share, TTFT with and without caching, running totals."""
    prompt_tokens, cached = len(out.prompt_token_ids), out.num_cached_tokens
    share = cached / prompt_tokens if prompt_tokens else 0.0
    write(f"  · prompt {prompt_tokens} tokens, {cached} from the prefix cache ({share:.0%})\n")
    if timing is not None and without is not None:
        same = without.outputs[0].token_ids == out.outputs[0].token_ids
        alike = all(c == cached for c in timing.cached_tokens)
        write(
            f"  · first token after {timing.on_ms:.1f} ms with caching, {timing.off_ms:.1f} ms "
            f"without ({'same' if same else 'DIFFERENT'} reply); medians of {timing.repeats} "
            f"interleaved runs, each from {'the same' if alike else 'a DIFFERENT'} cache state\n"
        )
    elif (on := _ms(out)) is not None:
        write(f"  · first token after {on:.1f} ms (one run)\n")
    queries, hits = totals["prefix_cache_queries"], totals["prefix_cache_hits"]
    rate = hits / queries if queries else 0.0
    write(
        f"  · all turns: {hits}/{queries} prompt tokens hit ({rate:.0%}), "
        f"{totals['state_snapshots_taken']} state snapshots taken, "
        f"{totals['prefix_cache_hybrid_misses']} hybrid misses\n"
    )

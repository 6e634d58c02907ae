"""``hybridkv demo``: what hybridkv does, in a scripted chat with the shipped demo model.

It prints the startup capacity report (KV capacity over attention groups only, state
slots, the concurrency cap and what binds it) beside what one unified page size would
give, then chats for a few turns. Each turn's prompt is the whole conversation so far,
rendered with the chat template as a chat client sends it, so the previous turn comes
back as a prefix: the recurrent state resumes from the snapshot taken where the last
reply ended. After every turn it prints the prompt tokens served from the prefix cache and
the time to first token with caching on against a second engine with caching off (same
model, same greedy reply). Both engines get the same warm-up request before the first
timed turn, and the running totals count from after it.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from hybridkv.cli.common import build_engine, flag_error, write
from hybridkv.cli.engine_args import add_engine_args

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
    p.set_defaults(run=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from hybridkv.engine import LLMEngine, SamplingParams
    from hybridkv.engine.llm import render_chat

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    except ValueError as exc:
        raise flag_error(exc, args) from None
    start = time.perf_counter()
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
    warm = engine.stats()
    write(f"model {engine.config.model}: ready in {time.perf_counter() - start:.1f} s\n")
    write("\ncapacity (the numbers `hybridkv plan` prints for these settings):\n")
    write("".join(f"  {line}\n" for line in engine.capacity_report))
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM_PROMPT}]
    for turn, question in enumerate(SCRIPT, start=1):
        messages.append({"role": "user", "content": question})
        prompt: PromptType = {"prompt_token_ids": render_chat(tokenizer, messages)}
        write(f"\n[turn {turn}] user: {question}\nassistant: ")
        out = _reply(engine, prompt, params)
        messages.append({"role": "assistant", "content": out.outputs[0].text})
        other = None if baseline is None else _reply(baseline, prompt, params, stream=False)
        print_turn_stats(out, other, since(warm, engine.stats()))
    return 0


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


def since(before: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """The demo's counters since ``before`` (after the warm-up), so totals count its turns only."""
    delta = {key: now[key] - before[key] for key in COUNTERS}
    queries = delta["prefix_cache_queries"]
    delta["prefix_cache_hit_rate"] = delta["prefix_cache_hits"] / queries if queries else 0.0
    return delta


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
    out: RequestOutput, without: RequestOutput | None, stats: dict[str, Any]
) -> None:
    """Per turn: this prompt's cached share, TTFT with and without caching, running totals."""
    prompt_tokens, cached = len(out.prompt_token_ids), out.num_cached_tokens
    share = cached / prompt_tokens if prompt_tokens else 0.0
    on, off = _ms(out), _ms(without)
    ttft = f"; first token after {on:.0f} ms" if on is not None else ""
    if on is not None and off is not None and without is not None:
        same = without.outputs[0].token_ids == out.outputs[0].token_ids
        ttft += f" with caching, {off:.0f} ms without ({'same' if same else 'DIFFERENT'} reply)"
    write(
        f"  · prompt {prompt_tokens} tokens, {cached} from the prefix cache ({share:.0%}){ttft}\n"
        f"  · all turns: {stats['prefix_cache_hits']}/{stats['prefix_cache_queries']} prompt "
        f"tokens hit ({stats['prefix_cache_hit_rate']:.0%}), {stats['state_snapshots_taken']} "
        f"state snapshots taken, {stats['prefix_cache_hybrid_misses']} hybrid misses\n"
    )

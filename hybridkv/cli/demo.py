"""``hybridkv demo``: build the embedded demo model once, then chat with it for a few turns.

Each turn's prompt is the whole conversation so far rendered with the chat template, as a
chat client sends it, so the previous turn's prompt and reply come back as a prefix. After
every turn the prefix-cache counters are printed: the cached share grows with the
conversation, which is the point of a prefix cache for hybrid models (the recurrent state
resumes from the snapshot taken where the last reply ended).
"""

from __future__ import annotations

import argparse
from typing import Any

from hybridkv.cli.common import build_engine, flag_error, write
from hybridkv.cli.engine_args import add_engine_args

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
        help="chat for a few turns with the embedded demo model, showing prefix-cache reuse",
        description="Build the small demo checkpoint once (into $HYBRIDKV_CACHE_DIR or "
        "~/.cache/hybridkv), then run a scripted multi-turn chat and print the prefix-cache "
        "statistics after each turn.",
    )
    add_engine_args(p, model_required=False)
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per reply at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.set_defaults(run=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from hybridkv.cli.generate import stream_completions
    from hybridkv.engine import SamplingParams
    from hybridkv.engine.llm import render_chat

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    except ValueError as exc:
        raise flag_error(exc, args) from None
    engine = build_engine(args)
    tokenizer = engine.tokenizer
    if tokenizer is None or tokenizer.chat_template is None:
        raise ValueError(f"{engine.config.model} has no chat template: the demo needs one")
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM_PROMPT}]
    for turn, question in enumerate(SCRIPT, start=1):
        messages.append({"role": "user", "content": question})
        prompt = {"prompt_token_ids": render_chat(tokenizer, messages)}
        write(f"\n[turn {turn}] user: {question}\nassistant: ")
        (out,) = stream_completions(engine, [prompt], params, write)
        messages.append({"role": "assistant", "content": out.outputs[0].text})
        print_turn_stats(out.num_cached_tokens, len(out.prompt_token_ids), engine.stats())
    return 0


def print_turn_stats(cached: int, prompt_tokens: int, stats: dict[str, Any]) -> None:
    """One line per turn: this prompt's cached share, then the cache's running totals."""
    share = cached / prompt_tokens if prompt_tokens else 0.0
    write(
        f"  · prompt {prompt_tokens} tokens, {cached} from the prefix cache ({share:.0%}); "
        f"all turns: {stats['prefix_cache_hits']}/{stats['prefix_cache_queries']} tokens hit "
        f"({stats['prefix_cache_hit_rate']:.0%}), {stats['state_snapshots_taken']} state "
        f"snapshots taken\n"
    )

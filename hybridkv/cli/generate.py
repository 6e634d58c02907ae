"""``hybridkv generate``: complete one or more prompts, streaming the text as it is made.

All prompts run together (continuous batching) but print one after another: the first
prompt's text streams live, the others' text is held until their turn comes. The CLI
drives ``LLMEngine.step()`` itself and prints the text deltas of each step, so what a user
sees is exactly the engine's own streaming output. Timings go to stderr, text to stdout.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from hybridkv.cli.common import build_engine, flag_error, write
from hybridkv.cli.engine_args import add_engine_args

if TYPE_CHECKING:
    from hybridkv.engine import LLMEngine, RequestOutput, SamplingParams
    from hybridkv.engine.inputs import PromptType


def add_generate_parser(commands: Any) -> None:
    p = commands.add_parser(
        "generate",
        help="complete prompts from the command line, streaming the text",
        description="Run PROMPT(s) through the engine and stream the completions to the "
        "terminal. Without --model, the demo model shipped in the package is used.",
    )
    add_engine_args(p, model_required=False)
    sampling = p.add_argument_group(
        "sampling",
        "unset fields take the model's generation_config.json defaults, else vLLM's "
        "(temperature 1.0: --temperature 0 for greedy)",
    )
    sampling.add_argument("--max-tokens", type=int, default=64, help="tokens per completion")
    sampling.add_argument("--temperature", type=float, default=None, help="0 is greedy")
    sampling.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass")
    sampling.add_argument("--top-k", type=int, default=None, help="keep the k likeliest (0: all)")
    sampling.add_argument("--min-p", type=float, default=None, help="relative probability floor")
    sampling.add_argument(
        "--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable)"
    )
    sampling.add_argument("--ignore-eos", action="store_true", help="generate past end-of-text")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("prompts", nargs="+", metavar="PROMPT", help="text to complete")
    p.set_defaults(run=run_generate)


def sampling_fields_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling fields given on the command line, checked.

    Raises:
        ValueError: naming the bad flag (before any model is loaded).
    """
    from hybridkv.engine import SamplingParams

    given = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "stop": args.stop,
        "ignore_eos": args.ignore_eos,
    }
    fields = {k: v for k, v in given.items() if v is not None}
    try:
        SamplingParams(**fields)
    except ValueError as exc:
        raise flag_error(exc, args) from None
    return fields


def run_generate(args: argparse.Namespace) -> int:
    if any(not p for p in args.prompts):
        raise ValueError("a PROMPT is empty")
    fields = sampling_fields_from_args(args)
    engine = build_engine(args)
    params = engine.default_sampling_params(**fields)
    prompts: list[PromptType] = list(args.prompts)
    if args.chat:
        prompts = chat_prompts(engine, args.prompts, args.system)
    several = len(prompts) > 1

    def header(index: int) -> str:
        return f"── prompt {index + 1}: {args.prompts[index]}\n" if several else ""

    start = time.perf_counter()
    outs = stream_completions(engine, prompts, params, write, header)
    print_summary(outs, time.perf_counter() - start)
    return 0


def chat_prompts(
    engine: LLMEngine, questions: Sequence[str], system: str | None
) -> list[PromptType]:
    """Each question as a one-turn conversation rendered with the checkpoint's template."""
    from hybridkv.engine.llm import render_chat

    if engine.tokenizer is None:
        raise ValueError("--chat needs a tokenizer, and this checkpoint has none")
    head = [{"role": "system", "content": system}] if system else []
    return [
        {"prompt_token_ids": render_chat(engine.tokenizer, [*head, {"role": "user", "content": q}])}
        for q in questions
    ]


def stop_prefix_chars(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of ``text`` that may be the start of a stop string.

    They are held back while the request runs: if the stop string completes, the engine
    cuts it from the text, and printed characters cannot be taken back.
    """
    held = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:n]):
                held = n
                break
    return held


def stream_completions(
    engine: LLMEngine,
    prompts: Sequence[PromptType],
    params: SamplingParams,
    write: Callable[[str], None],
    header: Callable[[int], str] | None = None,
) -> list[RequestOutput]:
    """Run ``prompts`` on ``engine`` together, writing their text in prompt order as it grows.

    Returns the final outputs, in the order of ``prompts``.

    Raises:
        ValueError: a bad prompt (nothing runs), or the engine gave up on one.
    """
    for i, prompt in enumerate(prompts):  # all or nothing: validate before queueing any
        try:
            engine.inputs.validate(prompt, params)
        except ValueError as exc:
            raise ValueError(f"prompt {i + 1}: {exc}") from None
    ids = [f"generate-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    latest: dict[str, RequestOutput] = {}
    current, shown = 0, 0  # the prompt being printed, and how much of its text is out
    if header is not None:
        write(header(0))
    while current < len(ids):
        for out in engine.step():
            latest[out.request_id] = out
        while current < len(ids) and (out := latest.get(ids[current])) is not None:
            if out.error is not None:
                raise ValueError(f"prompt {current + 1}: {out.error}")
            text = out.outputs[0].text
            if not out.finished:
                text = text[: len(text) - stop_prefix_chars(text, params.stop_strings)]
            if len(text) > shown:
                write(text[shown:])
                shown = len(text)
            if not out.finished:
                break
            write("\n")
            current, shown = current + 1, 0
            if header is not None and current < len(ids):
                write(header(current))
        if current < len(ids) and not engine.has_unfinished_requests():
            raise ValueError(f"prompt {current + 1} ended without a final output")
    return [latest[i] for i in ids]


def print_summary(outs: Sequence[RequestOutput], elapsed_s: float) -> None:
    """Token counts, rate and time to first token on stderr (stdout keeps only the text)."""
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    ttfts = [t for o in outs if o.metrics and (t := o.metrics.time_to_first_token) is not None]
    ttft = f", first token after {sum(ttfts) / len(ttfts):.3f} s" if ttfts else ""
    reasons = sorted({o.outputs[0].finish_reason or "?" for o in outs})
    print(
        f"[{len(outs)} prompt{'s' if len(outs) > 1 else ''}: {tokens} tokens in "
        f"{elapsed_s:.2f} s ({tokens / max(elapsed_s, 1e-9):.1f} tokens/s){ttft}; "
        f"{cached} prompt tokens from the prefix cache; finished by {', '.join(reasons)}]",
        file=sys.stderr,
    )

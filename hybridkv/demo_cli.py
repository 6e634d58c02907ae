"""``hybridkv demo``: build the embedded demo model once, then chat with it for a few turns.

Each turn's prompt is the whole conversation so far rendered with the chat template, as a
chat client sends it, so the previous turn's prompt and reply come back as a prefix. After
every turn the prefix-cache counters are printed: the cached share grows with the
conversation, which is the point of a prefix cache for hybrid models (the recurrent state
resumes from the snapshot taken where the last reply ended).

Also home of the model resolution ``generate`` and ``bench`` share: ``--model DIR`` is
checked up front (one-line error), and no ``--model`` means the demo model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridkv.engine_args import add_engine_args, engine_config_from_args

if TYPE_CHECKING:
    from hybridkv.engine import LLMEngine

SCRIPT = (
    "Hello!",
    "What color is the sky?",
    "What does a cow say?",
    "What is the capital of France?",
    "Thank you!",
)
SYSTEM_PROMPT = "You are a helpful assistant."


def check_model_dir(model: str) -> str:
    """``model`` if it looks like a checkpoint directory.

    Raises:
        ValueError: it does not exist, is not a directory, or has no config.json.
    """
    path = Path(model)
    if not path.exists():
        raise ValueError(f"--model {model}: no such directory")
    if not path.is_dir():
        raise ValueError(f"--model {model}: not a directory")
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {model}: no config.json in it (not a checkpoint directory)")
    return model


def model_or_demo(model: str | None) -> str:
    """The checkpoint to load: ``model`` (checked), else the demo model, built on first use.

    Raises:
        ValueError: a bad ``model``, or no ``model`` and no demo model in this install.
    """
    if model is not None:
        return check_model_dir(model)
    try:  # lazily: building it needs training code that other commands never load
        from hybridkv.demo_model import build_demo_model
    except ImportError as exc:
        raise ValueError(f"no --model given and the demo model is unavailable ({exc})") from None
    print("using the demo model (built on first use, then cached)", file=sys.stderr)
    return str(build_demo_model(progress=sys.stderr.isatty()))


def flag_error(exc: ValueError, args: argparse.Namespace) -> ValueError:
    """``exc`` with a leading field name written as the flag the user typed.

    EngineConfig and SamplingParams name their fields ("max_tokens must be ..."); on the
    command line the user wrote ``--max-tokens``, so that is what the message should say.
    """
    message = str(exc)
    name = message.split(" ", 1)[0]
    if name in vars(args):
        message = "--" + name.replace("_", "-") + message[len(name) :]
    return ValueError(message)


def build_engine(args: argparse.Namespace) -> LLMEngine:
    """The engine that the parsed engine flags describe (the demo model without --model).

    Raises:
        ValueError: a bad flag value, or a checkpoint that cannot be loaded.
    """
    model = model_or_demo(args.model)
    try:
        config = engine_config_from_args(args, model=model)
    except ValueError as exc:
        raise flag_error(exc, args) from None
    from hybridkv.engine import LLMEngine

    try:
        return LLMEngine(config)
    except (OSError, KeyError) as exc:  # unreadable or unsupported checkpoint files
        raise ValueError(f"cannot load {config.model}: {exc}") from None


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
    from hybridkv.engine import SamplingParams
    from hybridkv.engine.llm import render_chat
    from hybridkv.generate_cli import stream_completions

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


def write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def print_turn_stats(cached: int, prompt_tokens: int, stats: dict[str, Any]) -> None:
    """One line per turn: this prompt's cached share, then the cache's running totals."""
    share = cached / prompt_tokens if prompt_tokens else 0.0
    write(
        f"  · prompt {prompt_tokens} tokens, {cached} from the prefix cache ({share:.0%}); "
        f"all turns: {stats['prefix_cache_hits']}/{stats['prefix_cache_queries']} tokens hit "
        f"({stats['prefix_cache_hit_rate']:.0%}), {stats['state_snapshots_taken']} state "
        f"snapshots taken\n"
    )

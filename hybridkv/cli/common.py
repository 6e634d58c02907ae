"""What the engine subcommands share: which checkpoint to load, the engine it builds, the
flag names in error messages, and writing streamed text.

``--model DIR`` is checked up front (one-line error); no ``--model`` means the demo model
shipped in the package.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hybridkv.cli.engine_args import engine_config_from_args, model_arg

if TYPE_CHECKING:
    from hybridkv.engine import LLMEngine


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
    """The checkpoint to load: ``model`` (checked), else the demo model shipped in the package.

    Raises:
        ValueError: a bad ``model``, or no ``model`` and no demo model in this install.
    """
    if model is not None:
        return check_model_dir(model)
    from hybridkv.demo import shipped_demo_dir

    path = shipped_demo_dir()
    print(f"no model given: using the demo model shipped in {path}", file=sys.stderr)
    return str(path)


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
    model = model_or_demo(model_arg(args))
    try:
        config = engine_config_from_args(args, model=model)
    except ValueError as exc:
        raise flag_error(exc, args) from None
    from hybridkv.engine import LLMEngine

    try:
        return LLMEngine(config)
    except (OSError, KeyError) as exc:  # unreadable or unsupported checkpoint files
        raise ValueError(f"cannot load {config.model}: {exc}") from None


def write(text: str) -> None:
    """Streamed text to stdout, at once (timings and progress go to stderr)."""
    sys.stdout.write(text)
    sys.stdout.flush()

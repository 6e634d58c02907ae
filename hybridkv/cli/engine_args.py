"""Engine options on the command line, shared by ``serve``, ``generate``, ``bench``, ``demo``.

The flags are generated from :class:`hybridkv.engine.config.EngineConfig`
(:mod:`hybridkv.cli.config_args`): same names with dashes, same defaults, the field's
docstring line as help, so the CLI, the server and ``LLM(**options)`` never drift apart.
``serve`` takes the model as a positional argument, as ``vllm serve MODEL`` does.
"""

from __future__ import annotations

import argparse
from typing import Any

from hybridkv.cli.config_args import add_config_args, config_values
from hybridkv.engine.config import EngineConfig

MODEL_HELP = (
    "checkpoint directory (config.json, *.safetensors, tokenizer.json); none: the demo model"
)


def add_engine_args(
    parser: argparse.ArgumentParser, *, model_required: bool = True, positional_model: bool = False
) -> None:
    """The engine flags; the model as ``--model DIR`` or, with ``positional_model``, ``MODEL``."""
    group = parser.add_argument_group("engine")
    if positional_model:
        parser.add_argument("model", nargs="?", default=None, metavar="MODEL", help=MODEL_HELP)
        group.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)
    else:
        group.add_argument("--model", required=model_required, default=None, help=MODEL_HELP)
    add_config_args(group, EngineConfig, skip=("model",))


def model_arg(args: argparse.Namespace) -> str | None:
    """The model the user named: ``MODEL`` or ``--model`` (vLLM accepts both for serve).

    Raises:
        ValueError: both given, and different.
    """
    flag = getattr(args, "model_flag", None)
    if flag is not None and args.model is not None and flag != args.model:
        raise ValueError(f"MODEL {args.model} and --model {flag} disagree: give one")
    return args.model if args.model is not None else flag


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The EngineConfig the parsed flags describe (``overrides`` win, e.g. the model).

    Raises:
        ValueError: a flag value EngineConfig rejects (the message names it).
    """
    values = config_values(EngineConfig, args)
    values.update(overrides)
    return EngineConfig(**values)

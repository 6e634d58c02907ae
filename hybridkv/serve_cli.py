"""``hybridkv serve``: the OpenAI-compatible HTTP server over one model.

With no ``--model`` it serves the embedded demo model (built once into the cache directory
on first use), so ``hybridkv serve`` followed by the openai client works with zero set-up.
Engine flags are :mod:`hybridkv.engine_args`'s, shared with ``generate`` and ``bench``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from hybridkv.engine_args import add_engine_args, engine_config_from_args

DEMO_MODEL_NAME = "hybridkv-demo"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_serve_parser(commands: Any) -> None:
    p = commands.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions (streaming too), /v1/models, "
        "/health and Prometheus /metrics. Without --model, the embedded demo model is built "
        "once (into $HYBRIDKV_CACHE_DIR or ~/.cache/hybridkv) and served.",
    )
    add_engine_args(p, model_required=False)
    server = p.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    server.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    server.add_argument(
        "--served-model-name",
        default=None,
        help=f"the name clients pass as 'model' (default: --model as given, or {DEMO_MODEL_NAME})",
    )
    server.add_argument(
        "--api-key",
        default=os.environ.get("HYBRIDKV_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $HYBRIDKV_API_KEY, if set)",
    )
    server.add_argument(
        "--max-body-mib", type=float, default=4.0, help="larger request bodies get a 413"
    )
    server.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    server.add_argument(
        "--tool-call-parser",
        default="hermes",
        help="how the model writes tool calls, to parse them into OpenAI tool_calls and to "
        "constrain tool_choice 'required' / named (default hermes: <tool_call>{json}</tool_call>, "
        "Hermes and Qwen models)",
    )
    p.set_defaults(run=run_serve)


def resolve_model(model: str | None) -> tuple[str, str]:
    """(checkpoint directory, default served name); no ``model`` means the demo model.

    Raises:
        ValueError: ``model`` is not a checkpoint directory, or the demo model is unavailable.
    """
    if model is not None:
        path = Path(model)
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {model}: not a checkpoint directory (no config.json)")
        return model, model
    try:  # lazily: building it needs training code the server never loads otherwise
        from hybridkv.demo_model import build_demo_model
    except ImportError as exc:
        raise ValueError(f"no --model given and the demo model is unavailable ({exc})") from None
    print("no --model: serving the demo model (built on first use, then cached)", file=sys.stderr)
    return str(build_demo_model(progress=sys.stderr.isatty())), DEMO_MODEL_NAME


def run_serve(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if not 0 < args.max_body_mib < 1 << 20:
        raise ValueError(f"--max-body-mib must be positive, got {args.max_body_mib}")
    model_dir, default_name = resolve_model(args.model)
    config = engine_config_from_args(args, model=model_dir)
    import uvicorn

    from hybridkv.engine import LLMEngine
    from hybridkv.server import create_app
    from hybridkv.server.tool_parsers import get_tool_parser

    parser = get_tool_parser(args.tool_call_parser)  # an unknown name: a one-line error
    try:
        engine = LLMEngine(config)
    except (OSError, KeyError) as exc:  # unreadable or unsupported checkpoint files
        raise ValueError(f"cannot load {model_dir}: {exc}") from None
    name = args.served_model_name or default_name
    app = create_app(
        engine,
        name,
        api_key=args.api_key,
        max_body_bytes=int(args.max_body_mib * (1 << 20)),
        tool_parser=parser,
    )
    print(
        f"serving {name!r} (max_model_len {engine.max_model_len}) at "
        f"http://{args.host}:{args.port}/v1" + (" (API key required)" if args.api_key else ""),
        file=sys.stderr,
    )
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal to the
    # handler found at start-up; with Python's default SIGINT handler that is a
    # KeyboardInterrupt thrown into a loop that is closing (a traceback for a clean Ctrl-C).
    # The server has stopped by then, so the re-raised signal is acknowledged and ignored.
    previous = signal.signal(signal.SIGINT, _ignore_signal)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        signal.signal(signal.SIGINT, previous)
    return 0


def _ignore_signal(signum: int, frame: FrameType | None) -> None:
    """Stands in for the default handler while uvicorn owns the signals (see run_serve)."""

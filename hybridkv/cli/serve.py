"""``hybridkv serve``: the OpenAI-compatible HTTP server over one model.

With no ``--model`` it serves the embedded demo model (built once into the cache directory
on first use), so ``hybridkv serve`` followed by the openai client works with zero set-up.
Engine flags are :mod:`hybridkv.cli.engine_args`'s, shared with ``generate`` and ``bench``;
the engine is built by :func:`hybridkv.cli.common.build_engine` for all of them.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from types import FrameType
from typing import Any

from hybridkv.cli.common import build_engine
from hybridkv.cli.engine_args import add_engine_args
from hybridkv.core.units import MIB

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


def run_serve(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if not 0 < args.max_body_mib < MIB:
        raise ValueError(f"--max-body-mib must be positive, got {args.max_body_mib}")
    from hybridkv.server.tool_parsers import get_tool_parser

    parser = get_tool_parser(args.tool_call_parser)  # an unknown name: a one-line error
    engine = build_engine(args)
    import uvicorn

    from hybridkv.server import create_app

    name = args.served_model_name or args.model or DEMO_MODEL_NAME
    app = create_app(
        engine,
        name,
        api_key=args.api_key,
        max_body_bytes=int(args.max_body_mib * MIB),
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

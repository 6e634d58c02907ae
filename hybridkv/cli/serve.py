"""``hybridkv serve [MODEL]``: the OpenAI-compatible HTTP server over one model.

``vllm serve MODEL [flags]`` command lines work: MODEL is positional (``--model`` is
accepted too), the engine flags are generated from EngineConfig and the server flags from
ServerConfig (:mod:`hybridkv.cli.config_args`), under vLLM's names. With no MODEL it serves
the demo model shipped in the package, so ``hybridkv serve`` followed by the openai client
works with zero set-up. Start-up logs the capacity report.

Slow clients and shutdown (ServerConfig): request headers must arrive within
``--timeout-request-header`` seconds and bodies within ``--timeout-request-body``; idle
keep-alive connections close after ``--timeout-keep-alive``; at most
``--max-connections`` are open. SIGTERM (or Ctrl-C) stops accepting, gives running
requests up to ``--shutdown-timeout`` seconds, then cancels what is left and exits.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from types import FrameType
from typing import Any

from hybridkv.cli.common import build_engine, flag_error
from hybridkv.cli.config_args import add_config_args, config_values
from hybridkv.cli.engine_args import add_engine_args, model_arg
from hybridkv.server.config import ServerConfig

DEMO_MODEL_NAME = "hybridkv-demo"
API_KEY_ENVS = ("HYBRIDKV_API_KEY", "VLLM_API_KEY")


def add_serve_parser(commands: Any) -> None:
    p = commands.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions (streaming too), /v1/models, "
        "/tokenize, /detokenize, /health, /version, /docs and Prometheus /metrics. Without "
        "MODEL, the demo model shipped in the package is served. vLLM's flag names work.",
    )
    add_engine_args(p, positional_model=True)
    add_config_args(p.add_argument_group("server"), ServerConfig)
    p.set_defaults(run=run_serve)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig the flags describe; the API key from the environment if not given.

    Raises:
        ValueError: a bad value (the message names the flag).
    """
    values = config_values(ServerConfig, args)
    if values.get("api_key") is None:
        values["api_key"] = next((os.environ[e] for e in API_KEY_ENVS if os.environ.get(e)), None)
    try:
        return ServerConfig(**values)
    except ValueError as exc:
        raise flag_error(exc, args) from None


def run_serve(args: argparse.Namespace) -> int:
    server = server_config_from_args(args)
    from hybridkv.server.tool_parsers import get_tool_parser

    parser = get_tool_parser(server.tool_call_parser)  # an unknown name: a one-line error
    engine = build_engine(args)
    import uvicorn

    from hybridkv.server import create_app
    from hybridkv.server.connections import guarded_h11_protocol

    name = server.served_model_name or model_arg(args) or DEMO_MODEL_NAME
    app = create_app(engine, name, api_key=server.api_key, server=server, tool_parser=parser)
    print(
        f"serving {name!r} (max_model_len {engine.max_model_len}) at "
        f"http://{server.host}:{server.port}/v1"
        + (" (API key required)" if server.api_key else ""),
        file=sys.stderr,
    )
    config = uvicorn.Config(
        app,
        host=server.host,
        port=server.port,
        log_level=server.uvicorn_log_level,
        http=guarded_h11_protocol(server.timeout_request_header, server.max_connections),
        timeout_keep_alive=server.timeout_keep_alive,  # type: ignore[arg-type]
        timeout_graceful_shutdown=server.shutdown_timeout,  # type: ignore[arg-type]
    )
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal to the
    # handler found at start-up; with Python's default SIGINT handler that is a
    # KeyboardInterrupt thrown into a loop that is closing (a traceback for a clean Ctrl-C).
    # The server has stopped by then, so the re-raised signal is acknowledged and ignored.
    previous = signal.signal(signal.SIGINT, _ignore_signal)
    try:
        uvicorn.Server(config).run()
    finally:
        signal.signal(signal.SIGINT, previous)
    return 0


def _ignore_signal(signum: int, frame: FrameType | None) -> None:
    """Stands in for the default handler while uvicorn owns the signals (see run_serve)."""

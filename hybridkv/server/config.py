"""ServerConfig: the HTTP server's options, under vLLM's names where vLLM has them.

``hybridkv serve`` generates its server flags from this dataclass, as it does the engine's
from EngineConfig (:mod:`hybridkv.cli.config_args`). Torch-free: the CLI reads it to build
its parser.

Slow clients: a connection must send its request headers within
``timeout_request_header`` seconds and each piece of its body within
``timeout_request_body`` (else it is closed, or gets a 408); an idle keep-alive
connection closes after ``timeout_keep_alive``; at most ``max_connections`` are open at
once (more are refused with a 503). On SIGTERM the server stops accepting, lets running
requests finish for up to ``shutdown_timeout`` seconds, then closes every connection and
exits, whatever the clients do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridkv.core.units import MIB

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """How ``hybridkv serve`` listens.

    Attributes:
        host: address to bind.
        port: port to bind.
        served_model_name: the name clients pass as 'model' (default: the model as given,
            or hybridkv-demo).
        api_key: require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize,
            /docs and /openapi.json (default: $HYBRIDKV_API_KEY or $VLLM_API_KEY, if set).
        max_body_mib: larger request bodies get a 413.
        uvicorn_log_level: log level of the HTTP server.
        enable_log_requests: log every request (id, prompt tokens, sampling parameters).
        disable_log_requests: accepted for vLLM command lines (requests are not logged
            unless --enable-log-requests).
        disable_fastapi_docs: serve no /docs and /openapi.json.
        tool_call_parser: how the model writes tool calls, to parse them into OpenAI
            tool_calls and constrain tool_choice 'required' / named (hermes:
            <tool_call>{json}</tool_call>, Hermes and Qwen models).
        timeout_keep_alive: seconds an idle keep-alive connection stays open.
        timeout_request_header: seconds a new connection has to send its request headers.
        timeout_request_body: seconds a request body may stall between two pieces (408).
        max_connections: open connections at most; more are answered 503 and closed.
        shutdown_timeout: seconds SIGTERM waits for running requests before the server
            closes every connection and exits.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    max_body_mib: float = 4.0
    uvicorn_log_level: str = field(
        default="info", metadata={"choices": UVICORN_LOG_LEVELS, "aliases": ("--log-level",)}
    )
    enable_log_requests: bool = False
    disable_log_requests: bool = False
    disable_fastapi_docs: bool = False
    tool_call_parser: str = "hermes"
    timeout_keep_alive: float = 5.0
    timeout_request_header: float = 10.0
    timeout_request_body: float = 30.0
    max_connections: int = 1024
    shutdown_timeout: float = 30.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not 0 < self.max_body_mib < MIB:
            raise ValueError(f"max_body_mib must be positive, got {self.max_body_mib}")
        for name in (
            "timeout_keep_alive",
            "timeout_request_header",
            "timeout_request_body",
            "shutdown_timeout",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {self.max_connections}")
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(
                f"uvicorn_log_level must be one of {UVICORN_LOG_LEVELS}, "
                f"got {self.uvicorn_log_level!r}"
            )

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mib * MIB)

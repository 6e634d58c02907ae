"""Helpers of the server tests: a live uvicorn server in a thread, /metrics scraping."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from hybridkv.engine import LLMEngine

MODEL_NAME = "tiny-qwen35"
MAX_MODEL_LEN = 256
ENGINE_OPTIONS: dict[str, Any] = {
    "max_model_len": MAX_MODEL_LEN,
    "cache_memory_gib": 0.1,
    "max_num_seqs": 64,
}


@dataclass
class LiveServer:
    """A uvicorn server running an app in a daemon thread."""

    base_url: str
    server: Any
    thread: threading.Thread
    engine: LLMEngine

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def start_server(engine: LLMEngine, api_key: str | None = None) -> LiveServer:
    import uvicorn

    from hybridkv.server import create_app

    app = create_app(engine, MODEL_NAME, api_key=api_key)
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that name it, and without
    # it each POST's response waited ~40 ms for the client's delayed ACK
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return LiveServer(f"http://127.0.0.1:{port}", server, thread, engine)


COMMON_LABELS = re.compile(r'(model_name="[^"]*"|engine="0"),?')


def scrape(http: httpx.Client) -> dict[str, float]:
    """/metrics as {'name{labels}': value} (comments dropped), without the labels every
    series carries (``model_name``, ``engine``): ``vllm:num_requests_running``,
    ``hybridkv:pages_used{group="0",kind="attention"}``."""
    response = http.get("/metrics")
    assert response.status_code == 200
    values = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            key = COMMON_LABELS.sub("", key).replace(",}", "}").replace("{}", "")
            values[key] = float(value)
    return values


def pages_held(metrics: dict[str, float]) -> float:
    """Pages held by requests: running + waiting sequences, and pages_used of every group."""
    used = sum(v for k, v in metrics.items() if k.startswith("hybridkv:pages_used{"))
    return used + metrics["hybridkv:state_pages_used"]


def wait_idle(http: httpx.Client, timeout_s: float = 20.0) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and no page is held; the last scrape."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape(http)
        busy = metrics["vllm:num_requests_running"] + metrics["vllm:num_requests_waiting"]
        if busy == 0 and pages_held(metrics) == 0:
            return metrics
        if time.monotonic() > deadline:
            raise AssertionError(f"the server did not go idle: {metrics}")
        time.sleep(0.05)


def post_ascii(http: httpx.Client, path: str, body: Any) -> httpx.Response:
    """POST ``body`` as ASCII JSON: lone surrogates go out as ``\\ud800`` escapes, which
    JSON allows (httpx's own encoder refuses them)."""
    return http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})

"""Many clients at once, some of them hanging up: the others finish, nothing stays held.

Clients that disconnect ask for far more tokens than the others (``ignore_eos``), so they
would still be generating long after the others finish if a disconnect did not abort them;
the generated-token counter shows how much of their budget they consumed.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import ENGINE_OPTIONS, MODEL_NAME, LiveServer, scrape, start_server, wait_idle

from hybridkv.engine import EngineConfig, LLMEngine

NUM_CLIENTS = 32
COMPLETE_TOKENS = 8
ABANDONED_TOKENS = 200  # the prompt leaves room for it within max_model_len 256


def is_quitter(i: int) -> bool:
    return i % 3 == 0  # 11 of 32


def stream_one(base_url: str, i: int, start: threading.Barrier) -> dict[str, Any]:
    quitter = is_quitter(i)
    body = {
        "model": MODEL_NAME,
        "stream": True,
        "max_tokens": ABANDONED_TOKENS if quitter else COMPLETE_TOKENS,
        "temperature": 0 if i % 2 else 0.8,
        "seed": i,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    if i % 4 < 2:
        path, body["prompt"] = "/v1/completions", f"Client {i} says hello."
    else:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": f"Client {i}: hi"}]
    events: list[str] = []
    start.wait()
    with (
        httpx.Client(base_url=base_url, timeout=60) as http,
        http.stream("POST", path, json=body) as response,
    ):
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line:
                events.append(line.removeprefix("data: "))
            if quitter and len(events) == 1:
                break  # leaving the block closes the connection mid-stream
    return {"quitter": quitter, "events": events}


def test_32_streams_with_a_third_disconnecting(live: Any, http: httpx.Client) -> None:
    before = scrape(http)["vllm:generation_tokens_total"]
    start = threading.Barrier(NUM_CLIENTS)
    with ThreadPoolExecutor(NUM_CLIENTS) as pool:
        futures = [pool.submit(stream_one, live.base_url, i, start) for i in range(NUM_CLIENTS)]
        results = [f.result() for f in futures]
    completed = [r for r in results if not r["quitter"]]
    assert len(completed) == NUM_CLIENTS - 11
    completion_tokens = 0
    for result in completed:
        events = result["events"]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all("error" not in c for c in chunks)
        finish = [ch["finish_reason"] for c in chunks for ch in c["choices"]]
        assert finish[-1] == "length" and finish.count("length") == 1
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] == COMPLETE_TOKENS
        completion_tokens += usage["completion_tokens"]
    metrics = wait_idle(http, timeout_s=20)
    assert metrics["vllm:num_requests_running"] == 0
    assert metrics["vllm:num_requests_waiting"] == 0
    assert all(v == 0 for k, v in metrics.items() if k.startswith("hybridkv:pages_used{")), metrics
    assert metrics["hybridkv:state_pages_used"] == 0
    abandoned = metrics["vllm:generation_tokens_total"] - before - completion_tokens
    print(f"abandoned streams generated {abandoned:.0f} tokens")
    assert abandoned < 11 * ABANDONED_TOKENS / 2, f"disconnected streams ran on: {abandoned}"
    assert not live.engine.scheduler.running and not live.engine.scheduler.waiting
    ok = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200


LONG_REQUEST = 4000  # tokens: generating them takes the tiny model ~1 s, not ~50 ms


@pytest.fixture(scope="module")
def roomy(checkpoint: Path) -> Iterator[tuple[LiveServer, httpx.Client]]:
    """A server whose requests may run to :data:`LONG_REQUEST` tokens (the shared one's
    256-token limit lets the tiny model finish a whole request in ~50 ms, bursts of 16
    tokens a step, before a hang-up can reach it), and a client of it."""
    options = {**ENGINE_OPTIONS, "max_model_len": LONG_REQUEST + 64}
    server = start_server(LLMEngine(EngineConfig(model=str(checkpoint), **options)))
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        yield server, http
    server.stop()


def test_non_streaming_client_timeout_aborts(roomy: tuple[LiveServer, httpx.Client]) -> None:
    """A client that gives up on a non-streaming request gets its request cancelled too.

    The client hangs up once the request has generated (not after a fixed time: a fast
    engine finished all 240 tokens within the 0.3 s an earlier version waited), and the
    request is long enough that it cannot finish first (a CI run on a fast CPU saw all
    240 tokens of the former request generated before the hang-up reached it)."""
    live, http = roomy
    before = scrape(http)["vllm:generation_tokens_total"]
    body = json.dumps(
        {"model": MODEL_NAME, "prompt": "Tell me", "max_tokens": LONG_REQUEST, "ignore_eos": True}
    ).encode()
    url = httpx.URL(live.base_url)
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.create_connection((url.host, url.port), timeout=20) as impatient:
        impatient.sendall(request)
        deadline = time.monotonic() + 20
        while scrape(http)["vllm:generation_tokens_total"] == before:  # its first token
            assert time.monotonic() < deadline, "the request never started"
    metrics = wait_idle(http, timeout_s=20)  # the socket is closed: the client gave up
    generated = metrics["vllm:generation_tokens_total"] - before
    assert 0 < generated < LONG_REQUEST, f"the abandoned request ran to {generated} tokens"


def test_the_test_server_sends_without_nagles_delay(live: Any, http: httpx.Client) -> None:
    """Regression: the test server listened on a socket made without ``IPPROTO_TCP``, so
    asyncio did not set ``TCP_NODELAY`` on its connections (it checks the protocol number),
    and a response's body waited for the client's delayed ACK of its head: ~40 ms a POST,
    half of the fuzz test's 76 s. ``hybridkv serve`` binds by host and port and was not
    affected."""
    assert http.post("/tokenize", json={"prompt": "hi"}).status_code == 200
    connections = list(live.server.server_state.connections)
    assert connections
    for connection in connections:
        sock = connection.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)

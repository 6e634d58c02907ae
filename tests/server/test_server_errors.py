"""Bad input: an OpenAI-shaped 4xx naming the problem, no leaked pages, the server serves on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_helpers import ENGINE_OPTIONS, MAX_MODEL_LEN, MODEL_NAME, start_server, wait_idle

from hybridkv.engine import EngineConfig, LLMEngine

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
NAN_BODY = b'{"model": "%s", "prompt": "x", "temperature": NaN}' % MODEL_NAME.encode()


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": USER, "max_tokens": 4, **fields}


# (id, path, JSON body, status, words the message must contain, param)
BAD_BODIES = [
    ("missing-prompt", COMPLETIONS, {"model": MODEL_NAME}, 400, "prompt: field required", "prompt"),
    ("missing-model", COMPLETIONS, {"prompt": "x"}, 400, "model: field required", "model"),
    ("missing-messages", CHAT, {"model": MODEL_NAME}, 400, "messages: field required", "messages"),
    (
        "unknown-model",
        COMPLETIONS,
        completion(model="gpt-9"),
        404,
        "'gpt-9' does not exist",
        "model",
    ),
    ("unknown-model-chat", CHAT, chat(model="gpt-9"), 404, "does not exist", "model"),
    ("empty-prompt", COMPLETIONS, completion(prompt=""), 400, "prompt is empty", "prompt"),
    ("empty-ids", COMPLETIONS, completion(prompt=[]), 400, "prompt is empty", "prompt"),
    ("empty-nested", COMPLETIONS, completion(prompt=[[]]), 400, "prompt is empty", "prompt"),
    ("empty-in-list", COMPLETIONS, completion(prompt=["a", ""]), 400, "prompt 1 is", "prompt"),
    ("many-prompts", COMPLETIONS, completion(prompt=["a"] * 129), 400, "at most 128", "prompt"),
    (
        "logprob-flood",
        COMPLETIONS,
        completion(n=128, logprobs=20, max_tokens=200),
        400,
        "log-probability entries",
        "logprobs",
    ),
    ("float-ids", COMPLETIONS, completion(prompt=[1.5]), 400, "list of token ids", "prompt"),
    (
        "id-out-of-vocab",
        COMPLETIONS,
        completion(prompt=[10**6]),
        400,
        "outside the vocab",
        "prompt",
    ),
    (
        "max-tokens-0",
        COMPLETIONS,
        completion(max_tokens=0),
        400,
        "max_tokens must be",
        "max_tokens",
    ),
    ("max-tokens-neg", CHAT, chat(max_tokens=-3), 400, "max_tokens must be", "max_tokens"),
    ("max-tokens-str", COMPLETIONS, completion(max_tokens="5"), 400, "valid integer", "max_tokens"),
    ("max-compl-0", CHAT, chat(max_completion_tokens=0), 400, "max_tokens must", "max_tokens"),
    (
        "too-long",
        COMPLETIONS,
        completion(max_tokens=MAX_MODEL_LEN),
        400,
        f"maximum context length is {MAX_MODEL_LEN}",
        "max_tokens",
    ),
    (
        "prompt-too-long",
        CHAT,
        chat(messages=[{"role": "user", "content": "x" * MAX_MODEL_LEN}]),
        400,
        "maximum context length",
        "messages",
    ),
    (
        "temperature-neg",
        COMPLETIONS,
        completion(temperature=-0.5),
        400,
        "temperature",
        "temperature",
    ),
    ("temperature-str", CHAT, chat(temperature="hot"), 400, "valid number", "temperature"),
    ("top-p-0", COMPLETIONS, completion(top_p=0), 400, "top_p must be in (0, 1]", "top_p"),
    ("top-p-big", CHAT, chat(top_p=1.01), 400, "top_p must be in (0, 1]", "top_p"),
    ("n-0", COMPLETIONS, completion(n=0), 400, "n must be an integer >= 1", "n"),
    ("n-float", CHAT, chat(n=1.5), 400, "valid integer", "n"),
    ("n-over-128", COMPLETIONS, completion(n=129), 400, "less than or equal to 128", "n"),
    ("seed-over-int64", COMPLETIONS, completion(seed=2**64), 400, "less than", "seed"),
    ("unknown-role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "role", None),
    ("no-messages", CHAT, chat(messages=[]), 400, "at least 1 item", "messages"),
    ("content-missing", CHAT, chat(messages=[{"role": "user"}]), 400, "needs content", None),
    ("content-int", CHAT, chat(messages=[{"role": "user", "content": 3}]), 400, "string", None),
    ("messages-str", CHAT, chat(messages="hi"), 400, "valid list", "messages"),
    ("stop-int", COMPLETIONS, completion(stop=5), 400, "stop: must be a string", "stop"),
    ("stop-empty", COMPLETIONS, completion(stop=[""]), 400, "stop strings must not be empty", None),
    ("logprobs-big", COMPLETIONS, completion(logprobs=50), 400, "logprobs must be", "logprobs"),
    ("top-logprobs-alone", CHAT, chat(top_logprobs=2), 400, "needs logprobs", "top_logprobs"),
    ("penalty", CHAT, chat(presence_penalty=3.0), 400, "in [-2, 2]", "presence_penalty"),
    ("audio", CHAT, chat(modalities=["text", "audio"]), 400, "text only", "modalities"),
    ("rep-penalty-0", CHAT, chat(repetition_penalty=0), 400, "> 0", "repetition_penalty"),
    ("bias-key", COMPLETIONS, completion(logit_bias={"abc": 1}), 400, "keys", "logit_bias"),
    ("bias-range", COMPLETIONS, completion(logit_bias={"1": 150}), 400, "[-100", "logit_bias"),
    ("bias-vocab", COMPLETIONS, completion(logit_bias={"99999": 1}), 400, "outside the", None),
    ("min-tokens", COMPLETIONS, completion(min_tokens=9), 400, "min_tokens must", "min_tokens"),
    ("bad-words", COMPLETIONS, completion(bad_words=[""]), 400, "bad_words", "bad_words"),
    ("stream-str", COMPLETIONS, completion(stream="yes"), 400, "valid boolean", "stream"),
    ("body-list", COMPLETIONS, [1, 2], 400, "must be a JSON object", None),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "words", "param"),
    [case[1:] for case in BAD_BODIES],
    ids=[case[0] for case in BAD_BODIES],
)
def test_bad_body(
    http: httpx.Client, path: str, body: Any, status: int, words: str, param: str | None
) -> None:
    response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if param is not None:
        assert error["param"] == param
    assert "Traceback" not in response.text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_streaming_requests_are_refused_before_streaming(http: httpx.Client, stream: bool) -> None:
    """A refused streaming request is a plain 4xx JSON error, not an event stream."""
    response = http.post(COMPLETIONS, json=completion(temperature=-1, stream=stream))
    assert response.status_code == 400
    assert response.headers["content-type"].startswith("application/json")


@pytest.mark.parametrize(
    ("content", "headers", "words"),
    [
        (b'{"model": "x", "prompt": ', {"content-type": "application/json"}, "not valid JSON"),
        (b"\xff\xfe garbage", {"content-type": "application/json"}, "not valid JSON"),
        (b"", {"content-type": "application/json"}, "must be a JSON object"),
        (b'{"model": "x"}', {"content-type": "text/plain"}, "Content-Type: application/json"),
        (NAN_BODY, {"content-type": "application/json"}, "temperature must be a finite number"),
    ],
    ids=["truncated", "not-utf8", "empty", "wrong-content-type", "nan"],
)
def test_malformed_body(http: httpx.Client, content: bytes, headers: dict, words: str) -> None:
    response = http.post(COMPLETIONS, content=content, headers=headers)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]


def test_oversized_body_is_413(http: httpx.Client) -> None:
    prompt = "a" * (5 << 20)  # 5 MiB > the 4 MiB default limit
    response = http.post(COMPLETIONS, json=completion(prompt=prompt))
    assert response.status_code == 413
    assert "exceeds" in response.json()["error"]["message"]


def test_unknown_route_and_method(http: httpx.Client) -> None:
    missing = http.get("/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()
    wrong = http.get(COMPLETIONS)
    assert wrong.status_code == 405 and "error" in wrong.json()


def test_openai_client_raises_typed_errors(client: Any) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL_NAME, messages=USER, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "robot", "content": "x"}]
        )


def test_server_still_serves_and_leaks_nothing(http: httpx.Client, client: Any) -> None:
    """After every bad request above (module order), a good one works and no page is held."""
    for _, path, body, *_ in BAD_BODIES:
        http.post(path, json=body)
    response = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=3)
    assert response.usage.completion_tokens >= 1
    assert http.get("/health").status_code == 200
    wait_idle(http, timeout_s=10)


@pytest.fixture(scope="module")
def secured(checkpoint: Path) -> Iterator[str]:
    server = start_server(
        LLMEngine(EngineConfig(model=str(checkpoint), **ENGINE_OPTIONS)), api_key="s3cret"
    )
    yield server.base_url
    server.stop()


def test_api_key(secured: str) -> None:
    body = completion(max_tokens=2)
    with httpx.Client(base_url=secured, timeout=60) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            response = http.post(COMPLETIONS, json=body, headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/v1/models").status_code == 401
        ok = http.post(COMPLETIONS, json=body, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        # Probes stay open: health checks and Prometheus scrapers carry no credentials.
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200
    from openai import AuthenticationError, OpenAI

    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{secured}/v1", api_key="wrong", max_retries=0).models.list()
    good = OpenAI(base_url=f"{secured}/v1", api_key="s3cret", max_retries=0)
    assert good.models.list().data[0].id == MODEL_NAME


def test_tiny_temperature_samples_greedily(http: httpx.Client) -> None:
    """Regression: temperature 1e-45 made float32 logits / T overflow to NaN probabilities,
    and the failed sampling step failed every request in the batch. Below 1e-5 is greedy."""
    body = completion(max_tokens=6, ignore_eos=True, return_token_ids=True)
    greedy = http.post(COMPLETIONS, json={**body, "temperature": 0}).json()
    tiny = http.post(COMPLETIONS, json={**body, "temperature": 1e-45})
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"]


def test_engine_failure_is_a_500_without_traceback(
    http: httpx.Client, live: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model step that raises fails its requests with OpenAI-shaped errors, frees their
    pages, and the next request works."""

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(live.engine.runner, "execute", broken)
    whole = http.post(COMPLETIONS, json=completion())
    assert whole.status_code == 500
    assert whole.json()["error"]["type"] == "server_error"
    assert "simulated kernel failure" in whole.json()["error"]["message"]
    with http.stream("POST", COMPLETIONS, json=completion(stream=True)) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert "simulated kernel failure" in json.loads(lines[-2][6:])["error"]["message"]
    assert all("Traceback" not in line for line in lines)
    monkeypatch.undo()
    wait_idle(http, timeout_s=10)
    assert http.post(COMPLETIONS, json=completion()).status_code == 200

"""A bounded fuzz test: every field of both endpoints (and the tokenizer routes) gets
values of every wrong kind. Whatever a value does, the answer is a 2xx or a 4xx in
OpenAI's error shape, never a 5xx; afterwards the server is healthy and holds no page.

Deterministic: the same ~900 requests every run (each field x each value, on a small body
that generates at most 2 tokens), plus malformed bodies.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from server_helpers import MODEL_NAME, wait_idle

BAD_VALUES: list[Any] = [
    None, -1, 0, 1.5, 2**70, -(2**70), 1e308, float("nan"), float("inf"), True, "", "x",
    "a\ud800b", [], [None], [1, "a"], [[]], {}, {"a": [None, {"b": -1}]}, "9" * 5000,
]  # fmt: skip
SHARED_FIELDS = [
    "model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream",
    "stream_options", "presence_penalty", "frequency_penalty", "logit_bias", "best_of",
    "user", "top_k", "min_p", "ignore_eos", "stop_token_ids", "return_token_ids",
    "repetition_penalty", "min_tokens", "bad_words", "response_format", "structured_outputs",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar",
]  # fmt: skip
COMPLETION_FIELDS = ["prompt", "logprobs", "echo", "suffix", "prompt_logprobs"]
CHAT_FIELDS = [
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "add_generation_prompt",
    "chat_template_kwargs", "tools", "tool_choice", "parallel_tool_calls", "functions",
    "function_call",
]  # fmt: skip
NESTED = [  # values inside structures, where a bad one used to slip through
    {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": 1}}]}]},
    {"messages": [{"role": "tool", "content": None}]},
    {"messages": [{"role": "user", "content": "x", "name": "\ud800"}]},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
     "tool_choice": "required"},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": "str"}}]},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/x"}}}},
    {"structured_outputs": {"grammar": "start: start"}},
    {"structured_outputs": {"json": {"type": "array", "minItems": 5, "maxItems": 2}}},
    {"logit_bias": {"0": float("nan")}},
    {"stop": ["a"] * 10000},
    {"chat_template_kwargs": {"messages": []}},
    {"n": 128, "logprobs": True, "top_logprobs": 20, "max_tokens": 100},
]  # fmt: skip
COMPLETION = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def cases() -> list[tuple[str, Any]]:
    found: list[tuple[str, Any]] = []
    for path, base, fields in (
        ("/v1/completions", COMPLETION, SHARED_FIELDS + COMPLETION_FIELDS),
        ("/v1/chat/completions", CHAT, SHARED_FIELDS + CHAT_FIELDS),
    ):
        for name in fields:
            found += [(path, {**base, name: value}) for value in BAD_VALUES]
    found += [("/v1/chat/completions", {**CHAT, **extra}) for extra in NESTED]
    for value in BAD_VALUES:
        found.append(("/tokenize", {"prompt": value}))
        found.append(("/tokenize", {"messages": value}))
        found.append(("/detokenize", {"tokens": value}))
    return found


RAW_BODIES = [b"", b"{", b"[]", b"null", b"1", b'"x"', b"\xff\xfe", b'{"model": NaN}',
              b'{"prompt": "\\ud800"}', b"{" * 5000 + b"}" * 5000]  # fmt: skip


def test_no_input_is_a_server_error(http: httpx.Client) -> None:
    statuses: dict[int, int] = {}
    failures = []
    requests = cases()
    for path, body in requests:
        response = http.post(
            path, content=json.dumps(body), headers={"content-type": "application/json"}
        )
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        if response.status_code >= 500:
            failures.append((path, body, response.text[:300]))
        elif response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, response.text
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        for raw in RAW_BODIES:
            response = http.post(path, content=raw, headers={"content-type": "application/json"})
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            if response.status_code >= 500:
                failures.append((path, raw[:50], response.text[:300]))
    for model_id in ("x", "", "a/b", "%2e%2e", MODEL_NAME + "x"):
        assert http.get(f"/v1/models/{model_id}").status_code < 500
    print(f"{len(requests) + 4 * len(RAW_BODIES)} requests: {dict(sorted(statuses.items()))}")
    assert not failures, [(path, body) for path, body, _ in failures][:8]
    assert http.get("/health").status_code == 200
    wait_idle(http, timeout_s=60)

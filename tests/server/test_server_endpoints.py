"""vLLM's extra routes: ``GET /v1/models/{id}``, ``/tokenize``, ``/detokenize``, ``/version``."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from server_helpers import MAX_MODEL_LEN, MODEL_NAME, post_ascii

from hybridkv import __version__
from hybridkv.engine import LLM

MESSAGES = [{"role": "user", "content": "Hi there"}]


def test_retrieve_model(client: Any) -> None:
    card = client.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.object == "model"
    assert card.model_extra["max_model_len"] == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-9")


def test_version(http: httpx.Client) -> None:
    assert http.get("/version").json() == {"version": __version__}


def test_tokenize_prompt_and_messages(http: httpx.Client, offline: LLM) -> None:
    tokenizer = offline.get_tokenizer()
    response = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": "héllo"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["tokens"] == tokenizer.encode("héllo")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"] is None
    chat = http.post("/tokenize", json={"messages": MESSAGES, "return_token_strs": True}).json()
    [reference] = offline.chat(MESSAGES, use_tqdm=False, sampling_params=None)
    assert chat["tokens"] == reference.prompt_token_ids
    assert "".join(chat["token_strs"]) == tokenizer.decode(chat["tokens"], False)


def test_detokenize_round_trips(http: httpx.Client) -> None:
    ids = http.post("/tokenize", json={"prompt": "Round trip ✓"}).json()["tokens"]
    response = http.post("/detokenize", json={"model": MODEL_NAME, "tokens": ids})
    assert response.json() == {"prompt": "Round trip ✓"}


@pytest.mark.parametrize(
    ("path", "body", "words"),
    [
        ("/tokenize", {"prompt": "a\ud800b"}, "lone surrogate"),
        ("/tokenize", {}, "exactly one of"),
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "exactly one of"),
        ("/tokenize", {"prompt": "x", "model": "gpt-9"}, "does not exist"),
        ("/tokenize", {"prompt": "x" * 10**6}, "maximum context length"),
        ("/detokenize", {"tokens": [10**9]}, "outside the vocabulary"),
        ("/detokenize", {"tokens": [-1]}, "outside the vocabulary"),
        ("/detokenize", {"tokens": "abc"}, "valid list"),
    ],
)
def test_tokenizer_routes_refuse_bad_input(
    http: httpx.Client, path: str, body: dict[str, Any], words: str
) -> None:
    response = post_ascii(http, path, body)
    assert 400 <= response.status_code < 500, response.text
    assert words in response.json()["error"]["message"]

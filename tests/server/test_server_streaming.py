"""Streamed completions agree with the whole response: text offsets of streamed logprobs,
and the server is idle (no request, no page held) after the streams end.

Each test is the regression test of a bug found in review.
"""

from __future__ import annotations

import json

import httpx
from server_helpers import MODEL_NAME, wait_idle

COMPLETIONS = "/v1/completions"


def test_streamed_text_offsets_match_the_whole_response(http: httpx.Client) -> None:
    """With a stop string, ``DeltaTracker`` holds back ``len(stop) - 1`` characters while
    the tokens (and their logprobs) go out at once; ``completion_logprobs`` starts each
    delta's offsets at the characters already sent, so a token is given the offset of text
    that is still held back: the streamed ``text_offset`` list is not the one the same
    request gets without streaming."""
    body = {
        "model": MODEL_NAME,
        "prompt": "Offsets of every token",
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
        "stop": ["\x00\x01\x02\x03"],  # never generated, but held back while streaming
    }
    whole = http.post(COMPLETIONS, json=body)
    assert whole.status_code == 200, whole.text
    expected = whole.json()["choices"][0]["logprobs"]["text_offset"]
    streamed: list[int] = []
    with http.stream("POST", COMPLETIONS, json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    streamed += (choice.get("logprobs") or {}).get("text_offset") or []
    assert len(streamed) == len(expected) == 8
    assert streamed == expected


def test_review_leaves_the_live_server_idle(http: httpx.Client) -> None:
    wait_idle(http)

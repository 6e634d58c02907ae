"""The API through the official openai client: shapes, streaming, and equality with ``LLM``.

What "matches the offline engine" means here: the server returns its sampled token ids in
the ``return_token_ids`` extension (vLLM's name), and they must equal, id for id, what
``LLM.generate`` / ``LLM.chat`` produce for the same greedy request; the text and the
log-probabilities are compared too. The server runs each request alone (tests are
sequential), so both sides compute the same batch shapes.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from server_helpers import MAX_MODEL_LEN, MODEL_NAME, scrape, wait_idle

from hybridkv.engine import LLM, SamplingParams

PROMPT = "The quick brown fox jumps over"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 12}
EXTRA = {"ignore_eos": True, "return_token_ids": True}


def offline_ids(offline: LLM, prompt: Any, **params: Any) -> Any:
    [out] = offline.generate(prompt, SamplingParams(**params), use_tqdm=False)
    return out.outputs[0]


def test_models_and_health(client: Any, http: httpx.Client) -> None:
    [card] = client.models.list().data
    assert card.id == MODEL_NAME
    assert card.model_extra["max_model_len"] == MAX_MODEL_LEN
    assert http.get("/health").status_code == 200


def test_completion_matches_offline_engine(client: Any, offline: LLM) -> None:
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, logprobs=3, extra_body=EXTRA, **GREEDY
    )
    [choice] = response.choices
    ref = offline_ids(offline, PROMPT, temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    assert choice.model_extra["token_ids"] == ref.token_ids
    assert choice.text == ref.text
    assert choice.finish_reason == "length"
    sampled = [entry[t].logprob for entry, t in zip(ref.logprobs, ref.token_ids, strict=True)]
    assert choice.logprobs.token_logprobs == pytest.approx(sampled, abs=1e-4)
    assert all(len(top) <= 3 for top in choice.logprobs.top_logprobs)
    tokenizer = offline.get_tokenizer()
    assert response.model_extra["prompt_token_ids"] == tokenizer.encode(PROMPT)
    assert response.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert response.usage.completion_tokens == 12
    assert response.usage.total_tokens == response.usage.prompt_tokens + 12


def test_completion_from_token_ids(client: Any, offline: LLM) -> None:
    """A prompt of token ids, bare and as a one-element list, gives the same completion."""
    ids = offline.get_tokenizer().encode("Once upon a time")
    ref = offline_ids(offline, ids, temperature=0, max_tokens=12, ignore_eos=True)
    for prompt in (ids, [ids]):
        response = client.completions.create(
            model=MODEL_NAME, prompt=prompt, extra_body=EXTRA, **GREEDY
        )
        assert response.choices[0].model_extra["token_ids"] == ref.token_ids
        assert response.choices[0].text == ref.text


def test_chat_matches_offline_engine(client: Any, offline: LLM) -> None:
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        logprobs=True,
        top_logprobs=2,
        extra_body=EXTRA,
        **GREEDY,
    )
    [ref] = offline.chat(
        MESSAGES,
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
        use_tqdm=False,
    )
    [choice] = response.choices
    assert choice.message.role == "assistant"
    assert choice.model_extra["token_ids"] == ref.outputs[0].token_ids
    assert choice.message.content == ref.outputs[0].text
    assert response.model_extra["prompt_token_ids"] == ref.prompt_token_ids
    out = ref.outputs[0]
    sampled = [entry[t].logprob for entry, t in zip(out.logprobs, out.token_ids, strict=True)]
    assert [lp.logprob for lp in choice.logprobs.content] == pytest.approx(sampled, abs=1e-4)
    assert all(len(lp.top_logprobs) == 2 for lp in choice.logprobs.content)
    assert response.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_chat_max_completion_tokens(client: Any) -> None:
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        temperature=0,
        max_completion_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert response.usage.completion_tokens == 3
    assert response.choices[0].finish_reason == "length"


def test_streaming_completion_equals_non_streaming(client: Any) -> None:
    # 96 tokens, 12 rounds of bursts: with 12 (two rounds) a fast CPU sent the whole reply
    # as one chunk in a CI run of 2026-11-27 (a stream sends the newest of its cumulative
    # outputs when it wakes), and "it really streamed" failed
    greedy = {**GREEDY, "max_tokens": 96}
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, extra_body=EXTRA, **greedy)
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=EXTRA,
        **greedy,
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 96
    pieces = [c.choices[0] for c in chunks[:-1]]
    assert len(pieces) > 1  # it really streamed
    assert "".join(p.text for p in pieces) == whole.choices[0].text
    streamed_ids = [t for p in pieces for t in p.model_extra["token_ids"]]
    assert streamed_ids == whole.choices[0].model_extra["token_ids"]
    assert [p.finish_reason for p in pieces][-1] == "length"
    assert all(p.finish_reason is None for p in pieces[:-1])


def test_streaming_chat(client: Any) -> None:
    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, extra_body=EXTRA, **GREEDY
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, stream=True, extra_body=EXTRA, **GREEDY
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # include_usage not asked for


def test_sse_wire_format(http: httpx.Client) -> None:
    """Every event is one `data: <json>` line and the stream ends with `data: [DONE]`."""
    body = {"model": MODEL_NAME, "prompt": PROMPT, "stream": True, **GREEDY}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line.removeprefix("data: "))
        assert chunk["object"] == "text_completion"
        assert "token_ids" not in chunk["choices"][0]  # extensions only when asked for


def test_n_completions_and_seed(client: Any) -> None:
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8}
    first = client.completions.create(n=3, seed=7, temperature=1.0, **kwargs)
    again = client.completions.create(n=3, seed=7, temperature=1.0, **kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1  # the n samples differ
    stream = client.completions.create(n=2, stream=True, temperature=0, **kwargs)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts[0] == texts[1]  # greedy: both completions are the same


def test_stop_string_never_streamed(client: Any, offline: LLM) -> None:
    """Text a stream sent is never cut later: a stop string is held back until it fails."""
    ref = offline_ids(offline, PROMPT, temperature=0, max_tokens=12, ignore_eos=True).text
    stop = ref[4:6]  # two characters the greedy completion contains
    expected = ref[: ref.index(stop)]
    stream = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, stop=[stop], stream=True, extra_body=EXTRA, **GREEDY
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    whole = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, stop=stop, extra_body=EXTRA, **GREEDY
    )
    assert whole.choices[0].text == expected
    assert whole.choices[0].model_extra["stop_reason"] == stop


def test_prefix_cache_reported_in_usage(client: Any, http: httpx.Client) -> None:
    prompt = "A long shared system prompt that several requests reuse. " * 2
    before = scrape(http)["vllm:prefix_cache_hits_total"]
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, **GREEDY)
    second = client.completions.create(model=MODEL_NAME, prompt=prompt, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    metrics = wait_idle(http)
    assert metrics["vllm:prefix_cache_hits_total"] - before == cached


def test_metrics_exposes_engine_state(http: httpx.Client) -> None:
    metrics = wait_idle(http)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        'hybridkv:pages_used{group="0",kind="attention"}',
        'hybridkv:pages_free{group="1",kind="gdn"}',
        "hybridkv:state_pages_used",
        "vllm:prefix_cache_queries_total",
        "vllm:num_preemptions_total",
        "vllm:generation_tokens_total",
        "vllm:spec_decode_num_draft_tokens_total",  # 0: this server does not speculate
    ):
        assert name in metrics, name
    assert metrics["vllm:time_to_first_token_seconds_count"] > 0
    assert metrics["vllm:generation_tokens_total"] > 0


def test_penalties_and_logit_bias_match_the_offline_engine(client: Any, offline: LLM) -> None:
    """OpenAI's penalties and logit_bias, vLLM's repetition_penalty, min_tokens and bad_words
    reach the sampler: the server's tokens equal the offline engine's with the same params."""
    [a] = offline.get_tokenizer().encode("a")
    processors: dict[str, Any] = {
        "presence_penalty": 1.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.3,
        "min_tokens": 2,
        "bad_words": ["e"],
    }
    ref = offline_ids(offline, PROMPT, temperature=0, max_tokens=12, ignore_eos=True,
                      logit_bias={a: 3.0}, **processors)  # fmt: skip
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        presence_penalty=1.5,
        frequency_penalty=0.5,
        logit_bias={str(a): 3.0},
        extra_body={**EXTRA, **{k: v for k, v in processors.items() if "quency" not in k
                                and "presence" not in k}},
        **GREEDY,
    )  # fmt: skip
    assert response.choices[0].model_extra["token_ids"] == ref.token_ids
    plain = offline_ids(offline, PROMPT, temperature=0, max_tokens=12, ignore_eos=True)
    assert plain.token_ids != ref.token_ids
    forced = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, logit_bias={str(a): 100}, **GREEDY
    )
    assert forced.choices[0].text == "a" * 12

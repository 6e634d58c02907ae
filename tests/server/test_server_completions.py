"""Completions as vLLM serves them: prompt lists, echo, prompt log-probabilities, and
lm-evaluation-harness's ``local-completions`` end to end (a local task, nothing downloaded)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import MODEL_NAME, LiveServer, wait_idle

from hybridkv.engine import LLM, RequestOutputKind, SamplingParams

COMPLETIONS = "/v1/completions"
PROMPTS = ["The cat", "A dog barks at", "Rain"]


def offline_greedy(offline: LLM, prompt: Any, max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    [out] = offline.generate(prompt, params, use_tqdm=False)
    return out.outputs[0].token_ids


def offline_prompt_logprobs(offline: LLM, ids: list[int], k: int) -> list[Any]:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)
    [out] = offline.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    return out.prompt_logprobs


def test_prompt_list_gives_one_choice_per_prompt_and_n_in_order(
    http: httpx.Client, offline: LLM
) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPTS, "n": 2, "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    response = http.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    for i, prompt in enumerate(PROMPTS):
        expected = offline_greedy(offline, prompt, 5)
        assert choices[2 * i]["token_ids"] == choices[2 * i + 1]["token_ids"] == expected
    tokenizer = offline.get_tokenizer()
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] == sum(len(tokenizer.encode(p)) for p in PROMPTS)
    assert usage["completion_tokens"] == 30
    # token-id prompts, streamed: every choice's pieces assemble to the same tokens
    ids = [tokenizer.encode(p) for p in PROMPTS]
    streamed: dict[int, list[int]] = {}
    with http.stream("POST", COMPLETIONS, json={**body, "prompt": ids, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    streamed.setdefault(choice["index"], []).extend(choice["token_ids"])
    assert [streamed[i] for i in range(6)] == [c["token_ids"] for c in choices]


def test_echo_puts_the_prompt_first(http: httpx.Client, offline: LLM) -> None:
    body = {"model": MODEL_NAME, "prompt": "Echo me", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "echo": True}  # fmt: skip
    whole = http.post(COMPLETIONS, json=body).json()["choices"][0]["text"]
    plain = http.post(COMPLETIONS, json={**body, "echo": False}).json()["choices"][0]["text"]
    assert whole == "Echo me" + plain
    text = ""
    with http.stream("POST", COMPLETIONS, json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    assert text == whole


def test_lm_eval_request_shape_matches_the_engines_scoring(
    http: httpx.Client, offline: LLM
) -> None:
    """lm-eval's local-completions loglikelihood request: token-id prompts, echo,
    logprobs=1, max_tokens=1. The prompt's token logprobs must be the engine's own."""
    tokenizer = offline.get_tokenizer()
    prompts = [tokenizer.encode(t) for t in ("Paris is the capital of France", "2 + 2 = 4")]
    body = {"model": MODEL_NAME, "prompt": prompts, "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}  # fmt: skip
    response = http.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    for ids, choice in zip(prompts, response.json()["choices"], strict=True):
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(ids) + 1
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        reference = offline_prompt_logprobs(offline, ids, 1)
        expected = [reference[p][ids[p]].logprob for p in range(1, len(ids))]
        assert logprobs["token_logprobs"][1 : len(ids)] == pytest.approx(expected, abs=1e-4)
        for p in range(1, len(ids)):
            top = logprobs["top_logprobs"][p]
            assert len(top) == 1
            best = next(lp for lp in reference[p].values() if lp.rank == 1)
            assert list(top.values()) == pytest.approx([best.logprob], abs=1e-4)
        assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
        assert "".join(logprobs["tokens"]) == choice["text"]


def test_vllm_prompt_logprobs_field(http: httpx.Client, offline: LLM) -> None:
    ids = offline.get_tokenizer().encode("Score this")
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}
    [choice] = http.post(COMPLETIONS, json=body).json()["choices"]
    got = choice["prompt_logprobs"]
    reference = offline_prompt_logprobs(offline, ids, 2)
    assert got[0] is None and len(got) == len(ids)
    for p in range(1, len(ids)):
        assert got[p][str(ids[p])]["logprob"] == pytest.approx(
            reference[p][ids[p]].logprob, abs=1e-4
        )
        assert len(got[p]) in (2, 3)


TASK_YAML = """
task: hybridkv_tiny_loglikelihood
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
DOCS = [
    {"context": "The sky is", "continuation": "blue"},
    {"context": "One, two,", "continuation": "three"},
    {"context": "Hello", "continuation": "world"},
]


def test_lm_eval_loglikelihood_task_end_to_end(
    live: LiveServer, offline: LLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lm-evaluation-harness itself, local-completions with the server's own tokenizer
    routes (tokenizer_backend=remote), on a task defined here: its per-document
    loglikelihoods equal the engine's scoring of the same tokens."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "task.yaml").write_text(TASK_YAML.format(data=data))
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(
            f"model={MODEL_NAME},base_url={live.base_url}/v1/completions,"
            "tokenizer_backend=remote,num_concurrent=1,max_retries=1"
        ),
        tasks=["hybridkv_tiny_loglikelihood"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
        batch_size=2,
    )
    samples = results["samples"]["hybridkv_tiny_loglikelihood"]
    assert len(samples) == len(DOCS)
    tokenizer = offline.get_tokenizer()
    for sample in samples:
        [(context_text, continuation_text)] = sample["arguments"]  # what lm-eval scored
        assert sample["doc"]["context"] in context_text
        context = tokenizer.encode(context_text, add_special_tokens=False)
        ids = tokenizer.encode(context_text + continuation_text, add_special_tokens=False)
        reference = offline_prompt_logprobs(offline, ids, 1)
        expected = sum(reference[p][ids[p]].logprob for p in range(len(context), len(ids)))
        [[(loglikelihood, _greedy)]] = sample["resps"]
        assert float(loglikelihood) == pytest.approx(expected, abs=1e-3)
    wait_idle(httpx.Client(base_url=live.base_url))


def test_a_non_streaming_request_asks_the_engine_for_its_final_output_only(
    http: httpx.Client, live: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nobody reads a non-streaming request's outputs before it finishes, so it is queued
    as RequestOutputKind.FINAL_ONLY (no output per step, the text decoded once); a
    streamed one stays CUMULATIVE. Both answer the same tokens and text."""
    engine = live.engine
    kinds: list[RequestOutputKind] = []
    add_request = engine.add_request

    def recording(request_id: str, prompt: Any, params: Any = None, **kwargs: Any) -> None:
        kinds.append(params.output_kind)
        add_request(request_id, prompt, params, **kwargs)

    monkeypatch.setattr(engine, "add_request", recording)
    body = {"model": MODEL_NAME, "prompt": "The cat", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    plain = http.post(COMPLETIONS, json=body)
    assert plain.status_code == 200, plain.text
    with http.stream("POST", COMPLETIONS, json={**body, "stream": True}) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
    streamed = [json.loads(e)["choices"][0] for e in events if json.loads(e)["choices"]]
    assert kinds == [RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE]
    choice = plain.json()["choices"][0]
    assert "".join(c["text"] for c in streamed) == choice["text"]
    assert [t for c in streamed for t in c.get("token_ids") or []] == choice["token_ids"]

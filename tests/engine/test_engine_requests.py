"""How the engine takes requests and names their outputs: a batch is validated whole before
anything is queued, engine-made sequence ids never collide with user request ids, and output
text is decoded after the prompt's context (SentencePiece's leading space survives).

Each test is the regression test of a bug found in review.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from engine_checkpoints import ARCH, OPTIONS
from hybrid_checks import prompt
from tiny import write_metaspace_tokenizer

from hybridkv import LLM, SamplingParams
from hybridkv.engine import LLMEngine, RequestOutputKind


def ids(seed: int, n: int = 20) -> dict[str, list[int]]:
    return {"prompt_token_ids": prompt(seed, n)}


def drain(engine: LLMEngine, max_steps: int = 500) -> list[Any]:
    outputs = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outputs
        outputs += engine.step()
    raise AssertionError("the engine did not finish its requests")


def assert_idle(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    engine.manager.check_integrity()
    assert all(g["pages_used"] == 0 for g in engine.stats()["groups"])


def test_generate_queues_nothing_when_a_later_prompt_is_too_long(llm: LLM) -> None:
    """``generate`` promises 'nothing is queued then' on a ValueError, but it validates only
    the prompt encoding up front: the max_model_len check (and 'stop strings need a tokenizer')
    runs in ``add_request``, after the earlier prompts of the batch were queued. They then
    run unseen (their outputs are dropped by the next ``_run``), holding pages meanwhile."""
    engine = llm.engine
    short = ids(1, 10)
    too_long = ids(2, OPTIONS["max_model_len"])
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([short, too_long], SamplingParams(max_tokens=4), use_tqdm=False)
    leaked = engine.has_unfinished_requests()
    drain(engine)  # leave the shared engine clean for the other tests
    assert not leaked, "the first prompt was queued although generate raised"


def test_fanned_out_sequence_ids_do_not_collide_with_request_ids(llm: LLM) -> None:
    """Request 'a' with n=2 runs sequences 'a#0' and 'a#1'; a request named 'a#1' (n=1) runs
    a sequence 'a#1' too. ``add_request`` only checks request ids, so both are accepted and
    ``CacheManager.add_request`` raises inside ``schedule()``: ``step()`` itself raises,
    the second request never runs, and in the server every open request is failed."""
    engine = llm.engine
    params = SamplingParams(n=2, max_tokens=3, temperature=0, ignore_eos=True)
    engine.add_request("a", ids(3), params)
    engine.add_request("a#1", ids(4), SamplingParams(max_tokens=3, temperature=0))
    try:
        outs = {o.request_id: o for o in drain(engine) if o.finished}
    except ValueError:
        for request_id in ("a", "a#1"):  # recover the shared engine
            engine.abort_request(request_id)
        drain(engine)
        raise
    assert outs.keys() == {"a", "a#1"}
    assert all(o.error is None for o in outs.values())
    assert_idle(engine)


def test_output_text_keeps_the_space_before_the_first_word(
    checkpoints: Any, tmp_path: Path
) -> None:
    """The engine decoded the output ids alone. With a SentencePiece-style decoder
    (Llama, Mistral, Jamba, Zamba2 checkpoints) the first token's '▁' is stripped as if
    it began the text, so a completion of 'Hello' that generates '▁world' reads 'world',
    not ' world': prompt + completion no longer spell the decoded sequence. vLLM decodes
    with the prompt's last tokens as context (prefix/read offsets) for this reason."""
    _, path = checkpoints(ARCH)
    model_dir = tmp_path / "metaspace"
    shutil.copytree(path, model_dir)
    write_metaspace_tokenizer(model_dir)
    llm = LLM(str(model_dir), max_model_len=64, cache_memory_gib=0.02)
    tok = llm.get_tokenizer()
    assert tok is not None
    ids_in = prompt(5, 8)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": ids_in}, params, use_tqdm=False)[0].outputs[0]
    whole = tok.decode(ids_in + out.token_ids)
    assert whole.startswith(tok.decode(ids_in))
    assert out.text == whole[len(tok.decode(ids_in)) :]


def test_validate_request_is_public_and_checks_without_queueing(llm: LLM) -> None:
    """Regression: the architecture step moved the checks to InputProcessor and dropped
    LLMEngine.validate_request, which callers (the peer benchmark bench_engines.py) use to
    check a batch before queueing it."""
    engine = llm.engine
    params = SamplingParams(max_tokens=4)
    text, ids = engine.validate_request({"prompt_token_ids": [1, 2, 3]}, params)
    assert (text, ids) == (None, [1, 2, 3])
    with pytest.raises(ValueError, match="max_model_len"):
        engine.validate_request({"prompt_token_ids": [1] * engine.max_model_len}, params)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("arch", [ARCH, "bamba"])
def test_mamba_ssm_cache_dtype_reaches_the_state_pages(checkpoints: Any, arch: str) -> None:
    """vLLM's ``mamba_ssm_cache_dtype``: the SSM state pages take it, the rest keep the model
    dtype, and greedy generation runs over the mixed pages (a poisoned arena)."""
    from hybridkv.engine import EngineConfig

    _, path = checkpoints(arch)
    llm = LLM(
        model=str(path), **{**OPTIONS, "dtype": "float32", "mamba_ssm_cache_dtype": "bfloat16"}
    )
    state = {
        t.name: t.dtype for c in llm.engine.spec.layers for t in getattr(c.spec, "tensors", ())
    }
    assert state["ssm"] == "bfloat16" and state["conv"] == "float32"
    [out] = llm.generate(ids(7), SamplingParams(max_tokens=8, temperature=0.0))
    assert len(out.outputs[0].token_ids) == 8
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype"):
        EngineConfig(model=str(path), mamba_ssm_cache_dtype="fp8")


def test_bench_replay_reports_each_requests_first_token(llm: LLM) -> None:
    """The replay's per-request TTFT (seconds and steps) is what its means are made of,
    so a benchmark can split first turns from follow-ups."""
    from hybridkv.bench.workloads import BenchRequest, run_workload

    requests = [
        BenchRequest(req_id="a", new_token_ids=tuple(range(1, 20)), max_tokens=4),
        BenchRequest(req_id="b", new_token_ids=tuple(range(5, 30)), max_tokens=3, arrival_step=1),
        BenchRequest(req_id="a2", new_token_ids=(7, 8, 9), max_tokens=2, after="a"),
    ]
    result = run_workload(llm.engine, requests)
    ids = {r.req_id for r in requests}
    assert set(result.ttft_s) == ids and set(result.ttft_steps) == ids
    assert all(s >= 1 for s in result.ttft_steps.values())
    assert result.ttft_mean_s == pytest.approx(sum(result.ttft_s.values()) / len(ids))
    assert result.ttft_mean_steps == sum(result.ttft_steps.values()) / len(ids)
    assert "ttft_s" not in result.to_json() and "replies" not in result.to_json()


def test_final_only_requests_give_one_output_with_the_same_text(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RequestOutputKind.FINAL_ONLY (what ``LLM.generate`` asks for): one output per
    request, when it finishes, with the tokens and text of CUMULATIVE's last output.
    Without stop strings the text is decoded once, at the end (no detokenizer is made);
    with them it grows as before, since the stops read it."""
    engine = llm.engine
    made: list[str] = []
    detokenizer = engine._detokenizer

    def counting(seq: Any, req: Any) -> Any:
        made.append(req.request_id)
        return detokenizer(seq, req)

    monkeypatch.setattr(engine, "_detokenizer", counting)
    base = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    for stop in (None, ["\x00\x01never"]):
        runs = {}
        for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
            made.clear()
            params = SamplingParams(**base, stop=stop, output_kind=kind)
            for i in range(3):
                engine.add_request(f"{kind.name}-{stop}-{i}", ids(40 + i), params)
            outputs = drain(engine)
            runs[kind] = (outputs, set(made))
        cumulative, final_only = (
            runs[RequestOutputKind.CUMULATIVE],
            runs[RequestOutputKind.FINAL_ONLY],
        )
        assert len(cumulative[0]) > 3  # several outputs a request
        assert len(final_only[0]) == 3 and all(o.finished for o in final_only[0])
        last = {o.request_id.split("-", 1)[1]: o for o in cumulative[0] if o.finished}
        for out in final_only[0]:
            twin = last[out.request_id.split("-", 1)[1]]
            assert out.outputs[0].token_ids == twin.outputs[0].token_ids
            assert out.outputs[0].text == twin.outputs[0].text
            assert out.outputs[0].text  # the byte tokenizer decodes every id to something
        assert len(cumulative[1]) == 3
        assert len(final_only[1]) == (3 if stop else 0)
    assert_idle(engine)


def test_generate_asks_for_final_outputs_and_leaves_the_callers_params(llm: LLM) -> None:
    params = SamplingParams(max_tokens=3, temperature=0)
    outs = llm.generate([ids(50), ids(51)], params, use_tqdm=False)
    assert all(o.finished for o in outs)
    assert params.output_kind is RequestOutputKind.CUMULATIVE
    with pytest.raises(ValueError, match="DELTA is not supported"):
        SamplingParams(output_kind=RequestOutputKind.DELTA)
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=2)  # type: ignore[arg-type]


def test_generate_tokenizes_each_text_prompt_once(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``generate`` checks every prompt before queueing any, then queues what the check
    returned: a text prompt is tokenized once (it was twice: the check, then
    ``add_request``'s own), and its output still carries the text and the same ids."""
    tokenizer = llm.get_tokenizer()
    assert tokenizer is not None
    encoded: list[str] = []
    real = tokenizer.encode

    def counted(text: str, *args: Any, **kwargs: Any) -> Any:
        encoded.append(text)
        return real(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", counted)
    texts = ["one prompt", "another prompt"]
    outs = llm.generate(texts, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert sorted(encoded) == sorted(texts)
    assert [o.prompt for o in outs] == texts
    assert [o.prompt_token_ids for o in outs] == [real(t) for t in texts]
    assert_idle(llm.engine)

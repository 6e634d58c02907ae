"""Sampling, stop rules, n > 1, logprobs, aborts and bad input through the engine API."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from engine_checkpoints import ARCH, OPTIONS
from hybrid_checks import prompt

from hybridkv import LLM, SamplingParams
from hybridkv.engine import LLMEngine


def ids(seed: int, n: int = 20) -> dict[str, list[int]]:
    return {"prompt_token_ids": prompt(seed, n)}


def tokens_of(llm: LLM, requests: list[Any], params: Any) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)]


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm: LLM) -> None:
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    other = SamplingParams(max_tokens=5, temperature=0.9, ignore_eos=True)
    alone = tokens_of(llm, [ids(1)], seeded)[0]
    batched = tokens_of(llm, [ids(2), ids(1), ids(3)], [other, seeded, other])[1]
    assert alone == batched
    reseeded = SamplingParams(max_tokens=12, temperature=1.0, seed=8, ignore_eos=True)
    assert tokens_of(llm, [ids(1)], reseeded)[0] != alone


def test_top_k_one_and_tiny_top_p_are_greedy(llm: LLM) -> None:
    greedy = tokens_of(llm, [ids(4)], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for params in (
        SamplingParams(max_tokens=8, temperature=1.5, top_k=1, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=1.5, top_p=1e-6, seed=2, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=1.5, min_p=1.0, seed=3, ignore_eos=True),
    ):
        assert tokens_of(llm, [ids(4)], params) == greedy


def test_tiny_temperature_is_greedy(llm: LLM) -> None:
    """Regression: T = 1e-45 made 1/T overflow to NaN probabilities and failed the batch."""
    greedy = tokens_of(llm, [ids(4)], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    tiny = SamplingParams(max_tokens=6, temperature=1e-45, ignore_eos=True)
    assert tokens_of(llm, [ids(4)], tiny) == greedy


def test_largest_seeds_work(llm: LLM) -> None:
    """Regression: a seed near 2**64 (and its n > 1 children) overflowed in step()."""
    params = SamplingParams(n=2, max_tokens=3, seed=(1 << 64) - 1, ignore_eos=True)
    out = llm.generate([ids(4)], params, use_tqdm=False)[0]
    assert [len(c.token_ids) for c in out.outputs] == [3, 3]
    assert not llm.engine.has_unfinished_requests()


def test_n_completions(llm: LLM) -> None:
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=11, ignore_eos=True)
    out = llm.generate([ids(5)], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate([ids(5)], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    greedy = SamplingParams(n=2, max_tokens=6, temperature=0, ignore_eos=True)
    pair = llm.generate([ids(6)], greedy, use_tqdm=False)[0].outputs
    assert pair[0].token_ids == pair[1].token_ids


def test_stop_token_ids_end_the_completion_and_stay_in_it(llm: LLM) -> None:
    free = tokens_of(llm, [ids(9)], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[
        0
    ]
    stop_id = free[5]
    first = free.index(stop_id)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[stop_id])
    out = llm.generate([ids(9)], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)


def test_stop_strings_cut_the_text(llm: LLM) -> None:
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    free = llm.generate([ids(12)], params, use_tqdm=False)[0].outputs[0]
    text = free.text
    stop = next(text[i : i + 2] for i in range(3, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    at = text.index(stop)
    cut = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    out = llm.generate([ids(12)], cut, use_tqdm=False)[0].outputs[0]
    assert out.text == text[:at]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert len(out.token_ids) < len(free.token_ids)
    kept = SamplingParams(**{**_fields(cut), "include_stop_str_in_output": True})
    assert llm.generate([ids(12)], kept, use_tqdm=False)[0].outputs[0].text == text[: at + 2]


def _fields(params: SamplingParams) -> dict[str, Any]:
    names = SamplingParams.__dataclass_fields__
    return {k: getattr(params, k) for k in names if names[k].init}


def test_eos_ends_the_completion_unless_ignored(llm: LLM) -> None:
    eos = next(iter(llm.engine.eos_token_ids))
    assert eos == 258  # <|im_end|>, from generation_config.json
    # Make EOS the only possible token: it must stop the request after one token.
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=0, stop_token_ids=None)
    out = llm.generate([ids(13)], params, use_tqdm=False)[0].outputs[0]
    if eos in out.token_ids:
        assert out.token_ids[-1] == eos and out.finish_reason == "stop"
    long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    assert len(llm.generate([ids(13)], long, use_tqdm=False)[0].outputs[0].token_ids) == 40


def test_logprobs(llm: LLM) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=3, ignore_eos=True)
    out = llm.generate([ids(14)], params, use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 6
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry and 3 <= len(entry) <= 4
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks[:3] == [1, 2, 3]
        assert all(lp.logprob <= 0 for lp in entry.values())
        total += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(total)


def test_max_model_len_ends_generation(llm: LLM) -> None:
    params = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    out = llm.generate([ids(15, 120)], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 128 - 120 and out.finish_reason == "length"


def test_abort_frees_every_page(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("x", ids(16, 40), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("y", ids(17, 40), SamplingParams(max_tokens=50, ignore_eos=True, n=2))
    for _ in range(3):
        engine.step()
    assert engine.stats()["num_running"] == 3
    engine.abort_request("x")
    engine.abort_request("y")
    finals = {o.request_id: o for o in engine.step()}
    assert finals.keys() == {"x", "y"} and all(o.finished for o in finals.values())
    assert all(c.finish_reason == "abort" for o in finals.values() for c in o.outputs)
    assert not engine.has_unfinished_requests()
    engine.manager.check_integrity()
    assert all(g["pages_used"] == 0 for g in engine.stats()["groups"])


def test_chat_uses_the_template(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    assert tok is not None
    messages = [{"role": "user", "content": "hello"}]
    out = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    expected = tok.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", False)
    assert out.prompt_token_ids == expected
    with pytest.raises(ValueError, match="content"):
        llm.chat([{"role": "user"}], use_tqdm=False)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"seed": "x"}, "seed"),
        ({"seed": 1 << 64}, "seed"),  # regression: overflowed torch's manual_seed inside step
        ({"stop": [""]}, "stop"),
        ({"stop": 3}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": 99}, "logprobs"),
        ({"max_tokens": True}, "max_tokens"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_are_rejected_before_anything_runs(llm: LLM) -> None:
    engine = llm.engine
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([{"prompt_token_ids": [1, 99999]}], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([ids(1, 128)], use_tqdm=False)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate([ids(1)], [SamplingParams(), SamplingParams()], use_tqdm=False)
    engine.add_request("dup", ids(1), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", ids(1), SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["num_running"] == 0


def test_engine_options_are_checked(checkpoints: Any) -> None:
    _, path = checkpoints(ARCH)
    with pytest.raises(ValueError, match="does not fit in the cache"):
        LLMEngine.from_model(str(path), max_model_len=1 << 20, cache_memory_gib=0.01)
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(path), block_size=0)
    with pytest.raises(ValueError, match="checkpoint interval_tokens"):
        LLM(str(path), checkpoint_interval=20)
    with pytest.raises(ValueError, match="eviction"):
        LLM(str(path), eviction="fifo")
    with pytest.raises(TypeError):
        LLM(str(path), no_such_option=1)


def test_text_prompts_round_trip(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    assert tok is not None
    out = llm.generate("hello there", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert out[0].prompt == "hello there"
    assert tok.decode(out[0].prompt_token_ids) == "hello there"
    assert len(out[0].prompt_token_ids) == len("hello there")  # one token per byte
    completion = out[0].outputs[0]
    assert completion.text == tok.decode(completion.token_ids)  # finished: nothing held back


def test_streamed_text_only_grows_with_stop_strings(llm: LLM) -> None:
    """Regression: text streamed while running was cut back when a stop string completed."""
    engine = llm.engine
    free = llm.generate([ids(12)], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    text = free[0].outputs[0].text
    stop = next(text[i : i + 3] for i in range(3, len(text) - 3) if "\ufffd" not in text[i : i + 3])
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    engine.add_request("grow", ids(12), params)
    seen: list[str] = []
    while engine.has_unfinished_requests():
        seen += [o.outputs[0].text for o in engine.step() if o.request_id == "grow"]
    assert seen[-1] == text[: text.index(stop)]
    for before, after in itertools.pairwise(seen):
        assert after.startswith(before), (before, after)


def test_n_completions_compute_the_prompt_once(checkpoints: Any) -> None:
    """The second completion of an n = 2 request resumes from the first one's prompt."""
    _, path = checkpoints(ARCH)
    fresh = LLM(str(path), **OPTIONS)
    params = SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=5, ignore_eos=True)
    out = fresh.generate([ids(30, 50)], params, use_tqdm=False)[0]
    assert [len(c.token_ids) for c in out.outputs] == [4, 4]
    stats = fresh.stats()
    assert stats["prefix_cache_queries"] == 2 * 50
    assert stats["prefix_cache_hits"] == 48  # the sibling's hit: the prompt end, floor(49/16)*16

"""Logits processors against values computed by hand, and in the engine end to end."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from engine_checkpoints import ARCH
from tiny import EOS_ID, hf_greedy

from hybridkv.engine import LLM, SamplingParams
from hybridkv.engine.logits_processors import (
    RowContext,
    apply_bad_words,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
    process,
)
from hybridkv.engine.sampler import sample

INF = float("-inf")


def test_penalties_by_hand() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    apply_penalties(logits, prompt_ids=[0], output_ids=[1, 1, 2], params=params)
    # token 0: in the prompt, positive: 2 / 2 = 1; no output occurrence
    # token 1: output twice, negative: -1 * 2 = -2, - 0.5 * 2 - 0.25 = -3.25
    # token 2: output once, positive: 0.5 / 2 = 0.25, - 0.5 * 1 - 0.25 = -0.5
    # token 3: never seen: 3
    assert logits.tolist() == [1.0, -3.25, -0.5, 3.0]


def test_bad_words_ban_the_last_token_after_the_rest() -> None:
    words = [[5], [1, 2]]
    logits = torch.zeros(8)
    apply_bad_words(logits, words, output_ids=[7, 1])
    assert [i for i, v in enumerate(logits.tolist()) if v == INF] == [2, 5]
    logits = torch.zeros(8)
    apply_bad_words(logits, words, output_ids=[1, 7])
    assert [i for i, v in enumerate(logits.tolist()) if v == INF] == [5]
    logits = torch.zeros(8)
    apply_bad_words(logits, [[3, 4, 6]], output_ids=[4])  # longer than the output
    assert INF not in logits.tolist()


def test_min_tokens_and_logit_bias_by_hand() -> None:
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    apply_min_tokens(logits, num_outputs=1, min_tokens=2, stop_ids={3, 1})
    assert logits.tolist() == [0.0, INF, 2.0, INF]
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    apply_min_tokens(logits, num_outputs=2, min_tokens=2, stop_ids={3})
    assert logits.tolist() == [0.0, 1.0, 2.0, 3.0]
    apply_logit_bias(logits, {0: 100.0, 2: -5.5})
    assert logits.tolist() == [100.0, 1.0, -3.5, 3.0]


def test_process_keeps_the_raw_row_and_skips_when_idle() -> None:
    raw = torch.tensor([0.5, 2.0, 1.0])
    idle = RowContext(params=SamplingParams())
    assert process(raw, idle) is raw
    row = RowContext(params=SamplingParams(logit_bias={0: 10.0}), output_ids=[1])
    assert process(raw, row).tolist() == [10.5, 2.0, 1.0]
    assert raw.tolist() == [0.5, 2.0, 1.0]


def test_sampler_logprobs_are_the_raw_distribution() -> None:
    raw = torch.tensor([[0.5, 2.0, 1.0]])
    row = RowContext(params=SamplingParams(temperature=0, logit_bias={0: 10.0}, logprobs=1))
    [token] = sample(raw, [row])
    assert token.token_id == 0  # the bias made it the argmax
    expected = 0.5 - math.log(sum(math.exp(v) for v in (0.5, 2.0, 1.0)))
    assert token.logprob == pytest.approx(expected)
    assert token.rank == 3


def test_a_row_with_no_allowed_token_fails_alone() -> None:
    logits = torch.tensor([[1.0, 2.0], [1.0, 2.0]])
    banned = RowContext(params=SamplingParams(temperature=0, bad_words=["x"]), bad_words=[[0], [1]])
    fine = RowContext(params=SamplingParams(temperature=0))
    failed, ok = sample(logits, [banned, fine])
    assert "no token is allowed" in failed.message
    assert ok.token_id == 1


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": {1: 101}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ],
)
def test_bad_processor_params_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


# ---------------------------------------------------------------------------- in the engine


def greedy(llm: LLM, prompt: Any, **kwargs: Any) -> Any:
    params = SamplingParams(temperature=0, max_tokens=8, **kwargs)
    [out] = llm.generate(prompt, params, use_tqdm=False)
    assert out.error is None, out.error
    return out.outputs[0]


def test_repetition_penalty_matches_transformers(llm: LLM, checkpoints: Any) -> None:
    """transformers' RepetitionPenaltyLogitsProcessor is the same rule (prompt + output)."""
    model, _ = checkpoints(ARCH)
    ids = llm.get_tokenizer().encode("the quick brown fox jumps over the lazy dog 0123456789")
    plain, _ = hf_greedy(model, ids, 8)
    changed = 0
    for penalty in (1.8, 5.0, 50.0):
        ours = greedy(llm, {"prompt_token_ids": ids}, repetition_penalty=penalty, ignore_eos=True)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
                max_new_tokens=8,
                min_new_tokens=8,
                do_sample=False,
                repetition_penalty=penalty,
                eos_token_id=[],
                pad_token_id=0,
            )
        assert ours.token_ids == out[0, len(ids) :].tolist(), penalty
        changed += ours.token_ids != plain
    assert changed  # the penalty changed the greedy tokens at least once


def test_logit_bias_min_tokens_and_bad_words_in_the_engine(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    early_eos = greedy(llm, "Hello", logit_bias={EOS_ID: 100.0}, min_tokens=3)
    assert len(early_eos.token_ids) == 4 and early_eos.token_ids[-1] == EOS_ID
    assert EOS_ID not in early_eos.token_ids[:3] and early_eos.finish_reason == "stop"
    [a] = tokenizer.encode("a")
    favoured = greedy(llm, "Hello", ignore_eos=True, logit_bias={a: 100.0})
    assert favoured.text == "a" * 8
    banned = greedy(llm, "Hello", ignore_eos=True, logit_bias={a: 100.0}, bad_words=["a"])
    assert a not in banned.token_ids and len(banned.token_ids) == 8
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate("x", SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)

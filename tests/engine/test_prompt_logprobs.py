"""Prompt log-probabilities (vLLM's ``prompt_logprobs``) against transformers' full forward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_checkpoints import ARCH, OPTIONS
from hybrid_checks import prompt
from tiny import hf_logits

from hybridkv.engine import LLM, SamplingParams


def check_against_transformers(hf: Any, ids: list[int], got: list[Any], k: int) -> None:
    expected = torch.log_softmax(hf_logits(hf, ids), dim=-1)  # row p predicts token p + 1
    assert got[0] is None and len(got) == len(ids)
    for p in range(1, len(ids)):
        entry = got[p]
        row = expected[p - 1]
        assert entry[ids[p]].logprob == pytest.approx(float(row[ids[p]]), abs=1e-4), p
        assert entry[ids[p]].rank == int((row > row[ids[p]]).sum()) + 1
        top = sorted((lp for lp in entry.values() if lp.rank <= k), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == list(range(1, k + 1))
        assert [lp.logprob for lp in top] == pytest.approx(
            torch.topk(row, k).values.tolist(), abs=1e-4
        )


@pytest.mark.parametrize("chunk", [7, 2048], ids=["chunked", "whole"])
def test_prompt_logprobs_equal_transformers(checkpoints: Any, chunk: int) -> None:
    hf, path = checkpoints(ARCH)
    llm = LLM(str(path), **{**OPTIONS, "max_num_batched_tokens": chunk})
    ids = prompt(11, 30)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    first, again = (
        llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0] for _ in "ab"
    )
    check_against_transformers(hf, ids, first.prompt_logprobs, 3)
    # The second run would hit the prefix cache: the prompt is still computed in full.
    check_against_transformers(hf, ids, again.prompt_logprobs, 3)
    assert first.outputs[0].token_ids == again.outputs[0].token_ids


def test_prompt_logprobs_with_n_and_without(llm: LLM, checkpoints: Any) -> None:
    hf, _ = checkpoints(ARCH)
    ids = prompt(12, 20)
    params = SamplingParams(n=3, seed=1, max_tokens=3, prompt_logprobs=0)
    [out] = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    check_against_transformers(hf, ids, out.prompt_logprobs, 0)
    assert len(out.outputs) == 3
    [plain] = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1), use_tqdm=False)
    assert plain.prompt_logprobs is None
    [one] = llm.generate({"prompt_token_ids": ids[:1]}, params, use_tqdm=False)
    assert one.prompt_logprobs == [None]

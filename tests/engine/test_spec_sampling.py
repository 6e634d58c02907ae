"""Speculation at temperature > 0 keeps the engine's output distribution (the whole path:
n-gram drafts, the verification forward, rejection sampling, the kept tokens).

A tiny random Qwen3.5 with an 8-token vocabulary samples 3 tokens after a prompt that
repeats itself (so the n-gram proposer always finds drafts, and they are kept about as
often as the model samples them: some kept, most rejected), once per seed for many seeds.
The second and third tokens come out of verification windows; their counts are compared
by a chi-square test with their exact marginals, computed from transformers' logits over
every prefix. The same test run on an engine whose verification keeps every draft (a
broken rejection rule) fails it, so the test can see a real mistake.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_checkpoints import CONFIGS
from test_rejection_sampling import chi_square_pvalue
from tiny import hf_logits, make_hf, save_checkpoint

from hybridkv import LLM, SamplingParams
from hybridkv.engine.spec_decode import rejection

VOCAB = 8
DRAWS = 1_500
ALPHA = 1e-3
PROMPT = [*range(VOCAB), *range(VOCAB)]  # every first token has an n-gram match
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
OPTIONS: dict[str, Any] = {"max_model_len": 32, "block_size": 8, "cache_memory_gib": 0.05}


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """The checkpoint and the exact marginals of output tokens 2 and 3 (temperature 1)."""
    hf = make_hf("qwen3_5_text", {**CONFIGS["qwen3_5_text"], "vocab_size": VOCAB})
    path = save_checkpoint(hf, tmp_path_factory.mktemp("tiny_vocab"))

    def probs(ids: list[int]) -> torch.Tensor:
        return hf_logits(hf, ids)[-1].double().softmax(-1)

    p0 = probs(PROMPT)
    second, third = torch.zeros(VOCAB, dtype=torch.float64), torch.zeros(VOCAB, dtype=torch.float64)
    for t0 in range(VOCAB):
        p1 = probs([*PROMPT, t0])
        second += p0[t0] * p1
        for t1 in range(VOCAB):
            third += p0[t0] * p1[t1] * probs([*PROMPT, t0, t1])
    return path, second, third


def sample_counts(llm: LLM) -> tuple[Counter[int], Counter[int]]:
    params = [
        SamplingParams(max_tokens=3, temperature=1.0, seed=seed, ignore_eos=True)
        for seed in range(DRAWS)
    ]
    requests = [{"prompt_token_ids": PROMPT}] * DRAWS
    outs = [o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)]
    assert all(len(o) == 3 for o in outs)
    return Counter(o[1] for o in outs), Counter(o[2] for o in outs)


def speculating(path: Path) -> LLM:
    llm = LLM(str(path), speculative_config=NGRAM, **OPTIONS)
    assert llm.engine.speculator is not None
    llm.engine.speculator.always_verify = True  # verify every draft, paying or not
    return llm


def test_speculation_keeps_the_sampled_distribution(tiny_vocab: Any) -> None:
    path, second, third = tiny_vocab
    llm = speculating(path)
    counts = sample_counts(llm)
    stats = llm.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert stats["spec_decode_num_drafts"] >= DRAWS // 2, stats  # most tokens 2 were verified
    assert chi_square_pvalue(counts[0], second) > ALPHA, (counts[0], second)
    assert chi_square_pvalue(counts[1], third) > ALPHA, (counts[1], third)


def test_the_engine_chi_square_test_sees_a_broken_rejection_rule(
    tiny_vocab: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keeping every draft (no rejection) biases tokens 2 and 3 towards the drafts."""
    path, second, _ = tiny_vocab
    real = rejection.verify

    def keep_every_draft(rows: torch.Tensor, drafts: list[int], ctx: Any) -> Any:
        forced = rows.clone()
        for i, d in enumerate(drafts):  # the target puts all its mass on every draft
            forced[i] = -1e9
            forced[i, d] = 0.0
        return real(forced, drafts, ctx)

    monkeypatch.setattr("hybridkv.engine.llm_engine.verify", keep_every_draft)
    counts = sample_counts(speculating(path))
    assert chi_square_pvalue(counts[0], second) < 1e-6, (counts[0], second)

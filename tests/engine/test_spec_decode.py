"""Speculative decoding never changes a greedy answer: speculation on == off == transformers.

The checkpoints are the tiny random ones with their block outputs scaled down
(``copying_checkpoints``): their greedy output falls into loops, so the n-gram proposer's
drafts are partly kept and partly rejected, and every rejection rolls the recurrent states
back to the last kept position (a state that saw a rejected draft changes the next tokens,
which transformers' reference would catch). Every test also checks that drafts were kept
and rejected, so both paths ran.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_checkpoints import ARCHITECTURES, tight_cache_gib
from hybrid_checks import prompt
from test_engine_equivalence import assert_all_released, assert_transformers_greedy

from hybridkv import LLM, SamplingParams
from hybridkv.ops.gated_delta_rule import mixer_decode

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
OPTIONS: dict[str, Any] = {
    "max_model_len": 192,
    "block_size": 8,
    "checkpoint_interval": 16,
    "cache_memory_gib": 0.05,
    "poison_cache": True,
}
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
SHARED = prompt(5, 20)
PROMPTS = [SHARED + prompt(40 + i, 6 + 5 * i) for i in range(3)] + [prompt(49, 11)]


def speculating(path: Any, **options: Any) -> LLM:
    """An engine with n-gram speculation that verifies every draft it finds, paying or not
    (the speculator's cost rule would back off on some of these texts), so that every test
    runs verification and rollback."""
    llm = LLM(str(path), speculative_config=NGRAM, **options)
    assert llm.engine.speculator is not None
    llm.engine.speculator.always_verify = True
    return llm


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    requests = [{"prompt_token_ids": p} for p in prompts]
    return [o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)]


def assert_kept_and_rejected(llm: LLM) -> dict[str, Any]:
    """Drafts were verified, some kept and some rejected; the counters add up."""
    stats = llm.stats()
    drafts, kept = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    assert 0 < kept < drafts, stats
    assert sum(stats["spec_decode_num_accepted_tokens_per_pos"]) == kept
    assert stats["spec_decode_acceptance_rate"] == pytest.approx(kept / drafts)
    return stats


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_ngram_greedy_equals_no_speculation_equals_transformers(
    arch: str, copying_checkpoints: Any
) -> None:
    hf, path = copying_checkpoints(arch)
    on = speculating(path, **OPTIONS)
    off = LLM(str(path), **OPTIONS)
    # twice: the second round hits the prefix cache (blocks and snapshots written by
    # speculative steps must hold only verified tokens and states)
    first, second = generate(on, PROMPTS, GREEDY), generate(on, PROMPTS, GREEDY)
    reference = generate(off, PROMPTS, GREEDY)
    assert first == second == reference
    for p, tokens in zip(PROMPTS, reference, strict=True):
        assert_transformers_greedy(hf, p, tokens)
    stats = assert_kept_and_rejected(on)
    assert stats["prefix_cache_hits"] > 0
    assert_all_released(on)


@pytest.mark.parametrize("arch", ["qwen3_next", "jamba"])
def test_ngram_without_prefix_caching(arch: str, copying_checkpoints: Any) -> None:
    hf, path = copying_checkpoints(arch)
    on = speculating(path, enable_prefix_caching=False, **OPTIONS)
    for p, tokens in zip(PROMPTS, generate(on, PROMPTS, GREEDY), strict=True):
        assert_transformers_greedy(hf, p, tokens)
    assert_kept_and_rejected(on)
    assert on.stats()["prefix_cache_hits"] == 0
    assert_all_released(on)


@pytest.mark.parametrize("arch", ["qwen3_next", "nemotron_h", "jamba"])  # GDN, Mamba2, Mamba1
def test_preemption_in_the_middle_of_speculation(arch: str, copying_checkpoints: Any) -> None:
    hf, path = copying_checkpoints(arch)
    options = {**OPTIONS, "max_model_len": 128}
    tight = tight_cache_gib(path, options, state_pages=3 + NGRAM["num_speculative_tokens"])
    small = speculating(path, **{**options, "cache_memory_gib": tight})
    prompts = [SHARED + prompt(60 + i, 20 + 3 * i) for i in range(8)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    got = generate(small, prompts, params)
    stats = assert_kept_and_rejected(small)
    assert stats["num_preemptions"] > 0, stats
    assert_all_released(small)
    for p, tokens in zip(prompts, got, strict=True):
        assert_transformers_greedy(hf, p, tokens)


def test_n_stop_strings_and_max_tokens_inside_a_verification_window(
    copying_checkpoints: Any,
) -> None:
    """Requests that end in the middle of a window end where decoding one by one ends:
    max_tokens, stop token ids, stop strings; n > 1 copies speculate independently."""
    _, path = copying_checkpoints("qwen3_5_text")
    on = speculating(path, **OPTIONS)
    off = LLM(str(path), **OPTIONS)
    p = PROMPTS[1]
    full = generate(off, [p], GREEDY)[0]
    text = off.get_tokenizer().decode(full)
    cases = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in range(1, 10)]
    cases += [
        SamplingParams(max_tokens=48, temperature=0.0, stop_token_ids=[full[k]]) for k in (5, 23)
    ]
    cases += [
        SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, stop=[text[k : k + 2]])
        for k in (7, 30)
    ]
    cases.append(SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, n=3))
    requests = [{"prompt_token_ids": p}] * len(cases)
    for a, b in zip(
        on.generate(requests, cases, use_tqdm=False),
        off.generate(requests, cases, use_tqdm=False),
        strict=True,
    ):
        assert len(a.outputs) == len(b.outputs)
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == (
                y.token_ids,
                y.text,
                y.finish_reason,
                y.stop_reason,
            )
    assert_kept_and_rejected(on)
    assert_all_released(on)


def test_identical_draft_model_accepts_every_token(checkpoints: Any) -> None:
    hf, path = checkpoints("qwen3_5_text")
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    on = LLM(str(path), speculative_config=spec, **OPTIONS)
    got = generate(on, PROMPTS, GREEDY)
    assert got == generate(LLM(str(path), **OPTIONS), PROMPTS, GREEDY)
    for p, tokens in zip(PROMPTS, got, strict=True):
        assert_transformers_greedy(hf, p, tokens)
    stats = on.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0, stats
    assert stats["spec_decode_acceptance_rate"] == 1.0, stats
    assert_all_released(on)


def test_draft_model_of_another_architecture(copying_checkpoints: Any) -> None:
    """A Mamba2 hybrid drafts for a GDN hybrid: its own pages and states in the same
    arena; whatever it proposes, the target's greedy output is unchanged."""
    hf, path = copying_checkpoints("qwen3_next")
    _, draft = copying_checkpoints("nemotron_h")
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    on = LLM(str(path), speculative_config=spec, **OPTIONS)
    got = generate(on, PROMPTS, GREEDY)
    for p, tokens in zip(PROMPTS, got, strict=True):
        assert_transformers_greedy(hf, p, tokens)
    assert on.stats()["spec_decode_num_draft_tokens"] > 0
    assert any(g["group_id"] >= len(on.engine.spec.groups) for g in on.stats()["groups"])
    assert_all_released(on)


def test_a_draft_model_compiles_when_the_engine_starts(
    copying_checkpoints: Any, just_in_time: None
) -> None:
    """A GDN draft beside a target without GDN layers: the draft's compiled decode step
    (hybridkv.ops.compiled) compiles for its pages when the engine starts (without the
    draft's warm-up nothing compiles there), and speculating compiles nothing more (how many
    one-token draft forwards run depends on the speculator's cost fit, so this does not
    count them)."""
    _, path = copying_checkpoints("nemotron_h")
    _, draft = copying_checkpoints("qwen3_next")
    op = mixer_decode._mixer_decode
    torch._dynamo.reset()  # nothing compiled earlier in the process counts
    op.reset()
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    on = LLM(str(path), speculative_config=spec, **OPTIONS)
    graphs, calls = torch._dynamo.utils.counters["stats"]["unique_graphs"], op.num_compiled_calls
    assert calls > 0  # the draft's GDN layers warmed up
    generate(on, PROMPTS, GREEDY)
    assert on.stats()["spec_decode_num_draft_tokens"] > 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert_all_released(on)


def test_draft_model_with_another_vocabulary_is_refused(checkpoints: Any, tmp_path: Any) -> None:
    from engine_checkpoints import CONFIGS
    from tiny import make_hf, save_checkpoint

    _, path = checkpoints("qwen3_5_text")
    other = save_checkpoint(
        make_hf("qwen3_5_text", {**CONFIGS["qwen3_5_text"], "vocab_size": 300}), tmp_path
    )
    spec = {"method": "draft_model", "model": str(other), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="vocab_size 300 differs from the target's 260"):
        LLM(str(path), speculative_config=spec, **OPTIONS)

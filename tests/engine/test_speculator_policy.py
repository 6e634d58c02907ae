"""The speculator's policy: measured verification costs, acceptance estimates, and the
choice of draft counts that falls back to plain decoding when drafts do not pay."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from engine_checkpoints import build_checkpoint
from hybrid_checks import prompt

from hybridkv import LLM, SamplingParams
from hybridkv.engine.spec_decode.speculator import Speculator, StepCosts, choose_drafts
from hybridkv.sched.request import Sequence
from hybridkv.sched.scheduler import ScheduledChunk

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
OPTIONS: dict[str, Any] = {"max_model_len": 256, "block_size": 8, "cache_memory_gib": 0.05}
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def test_step_costs_follow_the_measured_line() -> None:
    """Verification steps costing 1 + 0.5 + 0.2 * drafts plain steps (2 ms each) pull the
    fit from its prior (1.0, 0.05) most of the way (the prior keeps a little weight)."""
    costs = StepCosts(fixed=1.0, per_draft=0.05, typical_drafts=8)
    for i in range(200):
        costs.observe(0, 0.002)
        drafts = 1 + i % 8
        costs.observe(drafts, 0.002 * (1 + 0.5 + 0.2 * drafts))
    assert costs.fixed == pytest.approx(0.5, abs=0.2)
    assert costs.per_draft == pytest.approx(0.2, abs=0.05)


def test_choose_drafts_pays_for_the_fixed_cost_once() -> None:
    costs = StepCosts(fixed=1.0, per_draft=0.1, typical_drafts=4)
    assert choose_drafts([(0.0, 4)] * 4, costs, 0) == [0, 0, 0, 0]  # nothing is kept
    assert choose_drafts([(0.95, 4)] * 4, costs, 0) == [4, 4, 4, 4]  # nearly all is kept
    # one good sequence alone pays the fixed cost; the bad one does not ride along
    assert choose_drafts([(0.95, 4), (0.05, 4)], costs, 0) == [4, 0]
    # a modest rate pays for one sequence but not when the step must also carry 7 others
    assert choose_drafts([(0.8, 4)], costs, 0)[0] > 0
    assert choose_drafts([(0.8, 4)], costs, 7) == [0]
    # with no fixed cost a cheap draft pays at a lower rate
    free = StepCosts(fixed=0.0, per_draft=0.05, typical_drafts=4)
    assert choose_drafts([(0.3, 4)], free, 0)[0] > 0


def test_speculates_on_quoted_text_and_backs_off_with_nothing_to_copy(
    checkpoints: Any, tmp_path: Path
) -> None:
    """The default policy (no forced verification): on prompts that quote the text the
    model writes (block outputs x 0.05: near-bigram, so it writes the quoted spans
    again), most drafts are kept; on a random model's text (nothing to copy) the free
    shadow trials keep it from verifying. Greedy output is unchanged either way."""
    copying = tmp_path / "copying"
    build_checkpoint("qwen3_5_text", copying, mixer_scale=0.05)
    off = LLM(str(copying), **OPTIONS)
    openings = [prompt(70 + i, 12) for i in range(3)]
    docs = [
        o.outputs[0].token_ids
        for o in off.generate([{"prompt_token_ids": p} for p in openings], GREEDY, use_tqdm=False)
    ]
    quoting = [{"prompt_token_ids": p + d + p} for p, d in zip(openings, docs, strict=True)]
    on = LLM(str(copying), speculative_config=NGRAM, **OPTIONS)
    got = [o.outputs[0].token_ids for o in on.generate(quoting, GREEDY, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in off.generate(quoting, GREEDY, use_tqdm=False)]
    stats = on.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0, stats
    assert stats["spec_decode_acceptance_rate"] > 0.5, stats

    _, plain = checkpoints("qwen3_5_text")
    random_prompts = [{"prompt_token_ids": prompt(80 + i, 30)} for i in range(3)]
    on = LLM(str(plain), speculative_config=NGRAM, **OPTIONS)
    got = [o.outputs[0].token_ids for o in on.generate(random_prompts, GREEDY, use_tqdm=False)]
    off = LLM(str(plain), **OPTIONS)
    assert got == [
        o.outputs[0].token_ids for o in off.generate(random_prompts, GREEDY, use_tqdm=False)
    ]
    stats = on.stats()
    generated = 3 * GREEDY.max_tokens
    assert stats["spec_decode_num_draft_tokens"] <= 0.05 * generated, stats


class _AlwaysGuesses:
    """A free proposer that always offers ``k`` drafts, first guess token 7."""

    free_guess = True

    def available(self, seq: Sequence, limit: int) -> int:
        return limit

    def guess(self, seq_id: str) -> int | None:
        return 7

    def fill(self, chunks: list[ScheduledChunk]) -> None:
        """Not reached: the test never schedules."""

    def forget(self, seq_id: str) -> None:
        """Nothing is kept."""


def decoding_sequence(index: int) -> Sequence:
    """A sequence past its prompt, decoding (what :meth:`Speculator.plan` drafts for)."""
    seq = Sequence(f"s{index}", "r", index, [1, 2, 3], SamplingParams(), output_token_ids=[4])
    seq.num_computed = seq.num_tokens - 1
    return seq


def plain_chunk(seq: Sequence) -> ScheduledChunk:
    """What :meth:`Speculator.record_plain` reads of a plain decode's chunk: its sequence."""
    return cast(ScheduledChunk, SimpleNamespace(seq=seq))


def test_noisy_cost_fit_does_not_stop_speculation_for_good() -> None:
    """Regression (21:35 run of benchmarks/spec_decode.py): a few noisy verification steps
    fitted a steep cost line and nothing was verified for the rest of the run. Such a fit
    still declines a step's drafts, but the speculator explores with the prior's choice,
    the exploring steps (cheap, as verification really is) feed the fit, and it verifies
    by itself again."""
    spec = Speculator(_AlwaysGuesses(), 2, cost_per_draft=0.05)
    seqs = [decoding_sequence(i) for i in range(4)]
    chunks = [plain_chunk(seq) for seq in seqs]

    def plain_step(step: int) -> None:  # four guesses in five are right: acceptance ~0.8
        for chunk in chunks:
            spec.record_plain(chunk, 7 if step % 5 else 8)

    for step in range(1, 21):
        spec.plan(seqs, lambda s: 2)
        plain_step(step)
    spec.costs.observe(0, 0.010)
    for drafts, excess in ((8, 2.5), (6, 2.4), (8, 2.6)):  # three noisy steps
        spec.costs.observe(drafts, 0.010 * (1 + excess))
    assert spec.costs.per_draft > 0.25  # a steep fit: without exploration, 40 plain steps
    verified = []
    for step in range(1, 41):
        spec.plan(seqs, lambda s: 2)
        drafts = sum(seq.num_draft_tokens for seq in seqs)
        verified.append(drafts)
        if drafts:  # a verification really costs 1.5 plain steps + 0.02 per draft
            spec.costs.observe(drafts, 0.010 * (1.5 + 0.02 * drafts))
        else:
            spec.costs.observe(0, 0.010)
            plain_step(step)
    assert any(verified[:8])  # explored within a few steps
    assert all(verified[-10:])  # the fit came back: it verifies every step by itself
    assert spec.costs.per_draft < 0.1


def test_no_exploration_when_drafts_do_not_pay_by_the_prior_either() -> None:
    """Nothing to copy: every free guess is wrong, the prior declines too, so the
    speculator never verifies (the >= 0.95x floor with nothing to copy)."""
    spec = Speculator(_AlwaysGuesses(), 4, cost_per_draft=0.05)
    seq = decoding_sequence(0)
    chunk = plain_chunk(seq)
    verified = 0
    for _ in range(200):
        spec.plan([seq], lambda s: 4)
        verified += seq.num_draft_tokens
        spec.record_plain(chunk, 8)
    assert verified == 0

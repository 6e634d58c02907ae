"""Qwen3-Next / Qwen3.5 / Qwen3.5-MoE over paged caches, against transformers (fp32).

Every comparison is with transformers' *full* forward (or its greedy generate), never with
its own chunked path. Tolerance: 1e-4 x max(1, logit scale) (notes: HF's own cached-vs-full
gap is ~2e-7; ours is a few 1e-6 from different summation orders).
"""

from __future__ import annotations

import pytest
import torch
from hybrid_checks import (
    assert_close,
    check_captures,
    check_fresh_state_page,
    check_greedy,
    check_mixed_batch,
    check_prefill,
    prompt,
)
from paged_runner import PagedRunner
from tiny import QWEN_MODEL_TYPES, hf_logits

PROMPT_TOKENS = 70  # crosses the GDN chunk (64) and four 16-token KV blocks


@pytest.fixture(params=QWEN_MODEL_TYPES)
def tiny(request: pytest.FixtureRequest, get_tiny):
    return get_tiny(request.param)


def test_prefill_matches_full_forward(tiny) -> None:
    check_prefill(*tiny, num_tokens=PROMPT_TOKENS)


def test_greedy_decode_matches_generate(tiny) -> None:
    check_greedy(*tiny, num_steps=32, prompt_tokens=20)


@pytest.mark.parametrize("sizes", [[1, 7, 16, 33], [16, 16, 16], [5, 1, 1, 60]], ids=str)
def test_chunked_prefill_matches_unsplit(tiny, sizes: list[int]) -> None:
    hf, lm = tiny
    ids = prompt(3, PROMPT_TOKENS)
    whole = PagedRunner(lm.model, lm.spec).step([("a", ids)], all_logits=True)
    split = PagedRunner(lm.model, lm.spec, seed=7).prefill_chunks("a", ids, sizes)
    assert_close(split, hf_logits(hf, ids))
    assert float((split - whole).abs().max()) <= 1e-4


def test_two_prefills_batched_equal_alone(tiny) -> None:
    _, lm = tiny
    a, b = prompt(4, 37), prompt(5, 21)
    alone_a = PagedRunner(lm.model, lm.spec).step([("a", a)])
    alone_b = PagedRunner(lm.model, lm.spec).step([("b", b)])
    together = PagedRunner(lm.model, lm.spec, seed=2).step([("a", a), ("b", b)])
    assert_close(together, torch.cat([alone_a, alone_b]))


def test_prefill_and_decode_mixed_in_one_batch(tiny) -> None:
    """Request a decodes while b prefills in a chunk and c decodes: same logits as alone."""
    check_mixed_batch(*tiny)


def test_fresh_request_reuses_a_dirty_state_page(tiny) -> None:
    """has_initial_state=False must ignore whatever an earlier request left in the page."""
    check_fresh_state_page(*tiny)


def test_state_captured_inside_prefill_equals_live_state(tiny) -> None:
    """In-forward captures (issues 12, 16) inside an 81-token chunk crossing the GDN chunk."""
    check_captures(tiny[1], num_tokens=90)

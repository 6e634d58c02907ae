"""Qwen3-Next / Qwen3.5 / Qwen3.5-MoE over paged caches, against transformers (fp32).

Every comparison is with transformers' *full* forward (or its greedy generate), never with
its own chunked path. Tolerance: 1e-4 x max(1, logit scale) (notes: HF's own cached-vs-full
gap is ~2e-7; ours is a few 1e-6 from different summation orders).
"""

from __future__ import annotations

import pytest
import torch
from paged_runner import PagedRunner
from tiny import QWEN_MODEL_TYPES, hf_greedy, hf_logits

PROMPT_TOKENS = 70  # crosses the GDN chunk (64) and four 16-token KV blocks


def prompt(seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_close(got: torch.Tensor, ref: torch.Tensor) -> float:
    diff = float((got - ref).abs().max())
    assert diff <= 1e-4 * max(1.0, float(ref.abs().max())), diff
    return diff


@pytest.fixture(params=QWEN_MODEL_TYPES)
def tiny(request: pytest.FixtureRequest, get_tiny):
    return get_tiny(request.param)


def test_prefill_matches_full_forward(tiny) -> None:
    hf, lm = tiny
    ids = prompt(1)
    got = PagedRunner(lm.model, lm.spec).step([("a", ids)], all_logits=True)
    assert torch.isfinite(got).all()
    assert_close(got, hf_logits(hf, ids))


def test_greedy_decode_matches_generate(tiny) -> None:
    hf, lm = tiny
    ids = prompt(2, 20)
    tokens, logits = PagedRunner(lm.model, lm.spec, seed=1).greedy("a", ids, 32)
    ref_tokens, ref_logits = hf_greedy(hf, ids, 32)
    pairs = enumerate(zip(tokens, ref_tokens, strict=True))
    diverged = next((i for i, (a, b) in pairs if a != b), None)
    upto = len(tokens) if diverged is None else diverged + 1
    assert_close(logits[:upto], ref_logits[:upto])
    if diverged is not None:  # a legitimate near-tie: HF's top-2 margin is within tolerance
        top2 = ref_logits[diverged].topk(2).values
        assert float(top2[0] - top2[1]) <= 1e-4, (diverged, tokens, ref_tokens)


@pytest.mark.parametrize("sizes", [[1, 7, 16, 33], [16, 16, 16], [5, 1, 1, 60]], ids=str)
def test_chunked_prefill_matches_unsplit(tiny, sizes: list[int]) -> None:
    hf, lm = tiny
    ids = prompt(3)
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
    hf, lm = tiny
    a, b, c = prompt(6, 30), prompt(7, 45), prompt(8, 17)
    runner = PagedRunner(lm.model, lm.spec, seed=3)
    runner.step([("a", a[:-1]), ("c", c[:-1])])
    runner.step([("b", b[:20])])
    mixed = runner.step([("a", a[-1:]), ("b", b[20:]), ("c", c[-1:])])
    refs = torch.stack([hf_logits(hf, x)[-1] for x in (a, b, c)])
    assert_close(mixed, refs)


def test_fresh_request_reuses_a_dirty_state_page(tiny) -> None:
    """has_initial_state=False must ignore whatever an earlier request left in the page."""
    hf, lm = tiny
    runner = PagedRunner(lm.model, lm.spec)
    runner.step([("old", prompt(9, 25))])
    ids = prompt(10, 12)
    runner.reqs["new"] = runner.reqs.pop("old")  # same pages, state full of old data
    runner.reqs["new"].num_computed = 0
    got = runner.step([("new", ids)], all_logits=True)
    assert_close(got, hf_logits(hf, ids))

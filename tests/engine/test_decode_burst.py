"""Decode bursts (hybridkv.engine.decode_burst) change how many rounds a reply takes, never
the reply: with bursts (the default, ``decode_burst=8``) every reply equals the engine's
one-token steps (``decode_burst=1``) and transformers' greedy tokens, caching on and off,
on a poisoned cache (a read of memory nobody wrote shows as NaN logits).

Bursts run through the decode graph, so these tests skip where packages are off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_checkpoints import ARCH, OPTIONS
from hybrid_checks import prompt
from tiny import hf_greedy

from hybridkv.engine import EngineConfig, LLMEngine
from hybridkv.ops import ahead_of_time
from hybridkv.ops.compiled import compile_enabled
from hybridkv.sched.sampling_params import SamplingParams

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def engine(path: Path, *, caching: bool = True, burst: int = 8) -> LLMEngine:
    if not ahead_of_time.available() or not compile_enabled():
        pytest.skip("packages are off here: no decode graph to burst through")
    return LLMEngine(
        EngineConfig(model=str(path), enable_prefix_caching=caching, decode_burst=burst, **OPTIONS)
    )


def run(
    llm: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, tuple[list[int], str | None, int]]:
    """request id -> (its tokens, finish reason, prompt tokens served from the cache)."""
    for request_id, (ids, params) in requests.items():
        llm.add_request(request_id, ids, params)
    replies: dict[str, tuple[list[int], str | None, int]] = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            assert out.error is None, out.error
            if out.finished:
                done = out.outputs[0]
                replies[out.request_id] = (
                    list(done.token_ids),
                    done.finish_reason,
                    out.num_cached_tokens,
                )
    return replies


@pytest.mark.parametrize("caching", [True, False])
def test_replies_with_bursts_equal_one_token_steps_and_transformers(
    checkpoints: Any, caching: bool
) -> None:
    """Ragged work: prompts of 3-45 tokens, 2-40 tokens out, so requests leave bursts
    midway (the others go on alone) and cross page and snapshot boundaries inside them."""
    hf, path = checkpoints(ARCH)
    lengths = [2, 40, 9, 17, 33, 5]
    requests = {
        f"r{i}": (prompt(70 + i, 3 + 8 * i), SamplingParams(max_tokens=n, **GREEDY))
        for i, n in enumerate(lengths)
    }
    bursting, single = engine(path, caching=caching), engine(path, caching=caching, burst=1)
    with_bursts, without = run(bursting, requests), run(single, requests)
    assert with_bursts == without
    for request_id, (ids, params) in requests.items():
        assert with_bursts[request_id][0] == hf_greedy(hf, ids, params.max_tokens)[0]
    assert bursting.stats()["num_burst_forwards"] > 0
    assert single.stats()["num_burst_forwards"] == 0
    assert bursting.num_steps < single.num_steps


def test_a_stop_inside_a_burst_ends_the_reply_there_and_nothing_past_it_is_cached(
    checkpoints: Any,
) -> None:
    """The reply stops at a stop token the burst ran past; a follow-up turn built on that
    reply hits the cache exactly as without bursts, and both equal transformers (a state
    or KV page from past the stop, if it were cached, would change its tokens)."""
    hf, path = checkpoints(ARCH)
    first = prompt(80, 30)
    free_run = hf_greedy(hf, first, 20)[0]
    stop_at = next(i for i in range(3, 20) if free_run[i] not in free_run[:i])
    params = SamplingParams(max_tokens=20, stop_token_ids=[free_run[stop_at]], **GREEDY)
    replies = []
    for burst in (8, 1):
        llm = engine(path, burst=burst)
        reply, reason, _ = run(llm, {"t1": (first, params)})["t1"]
        follow_up = first + reply + prompt(81, 7)
        second = run(llm, {"t2": (follow_up, SamplingParams(max_tokens=12, **GREEDY))})["t2"]
        replies.append((reply, reason, second))
    assert replies[0] == replies[1]
    reply, reason, (second, _, cached) = replies[0]
    assert (reply, reason) == (free_run[: stop_at + 1], "stop")
    assert cached > len(first)
    assert second == hf_greedy(hf, first + reply + prompt(81, 7), 12)[0]


@pytest.mark.parametrize(
    "other",
    [
        {"temperature": 0.8, "seed": 3},
        {"temperature": 0.0, "logprobs": 2},
        {"temperature": 0.0, "repetition_penalty": 1.3},
    ],
    ids=["sampled", "logprobs", "penalty"],
)
def test_a_request_that_is_not_plain_greedy_keeps_every_round_to_one_token(
    checkpoints: Any, other: dict[str, Any]
) -> None:
    """Beside a request whose token is not its raw argmax (or that reports logprobs) no
    round bursts, and its reply is the one it gets without bursts."""
    _, path = checkpoints(ARCH)
    requests = {
        "plain": (prompt(90, 12), SamplingParams(max_tokens=12, **GREEDY)),
        "other": (prompt(91, 12), SamplingParams(max_tokens=12, ignore_eos=True, **other)),
    }
    bursting = engine(path)
    assert run(bursting, requests) == run(engine(path, burst=1), requests)
    assert bursting.stats()["num_burst_forwards"] == 0


def test_a_request_arriving_during_bursts_waits_for_the_round_and_replies_as_alone(
    checkpoints: Any,
) -> None:
    hf, path = checkpoints(ARCH)
    llm = engine(path)
    for i in range(3):
        llm.add_request(f"r{i}", prompt(100 + i, 10), SamplingParams(max_tokens=30, **GREEDY))
    llm.step()  # the prefills
    llm.step()  # a burst round
    assert llm.stats()["num_burst_forwards"] > 0
    late = prompt(110, 14)
    replies = run(llm, {"late": (late, SamplingParams(max_tokens=10, **GREEDY))})
    assert replies["late"][0] == hf_greedy(hf, late, 10)[0]


def test_decode_burst_must_be_a_positive_integer(tmp_path: Path) -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="decode_burst must be a positive integer"):
            EngineConfig(model=str(tmp_path), decode_burst=bad)  # type: ignore[arg-type]

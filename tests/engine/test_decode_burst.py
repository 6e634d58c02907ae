"""Decode bursts (hybridkv.engine.decode_burst) change how many rounds a reply takes, never
the reply: with bursts (the default, ``decode_burst=8``) every reply equals the engine's
one-token steps (``decode_burst=1``) and transformers' greedy tokens, caching on and off,
on a poisoned cache (a read of memory nobody wrote shows as NaN logits).

Bursts run through the decode graph, so these tests skip where packages are off.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from engine_checkpoints import ARCH, OPTIONS
from hybrid_checks import prompt
from tiny import hf_greedy

from hybridkv.core.ids import ReqId
from hybridkv.engine import LLM, EngineConfig, LLMEngine
from hybridkv.engine.decode_burst import (
    BURST_BUDGET_S,
    BurstTokens,
    ForwardTimes,
    _stop_at,
    burst_length,
    plan_burst,
)
from hybridkv.ops import ahead_of_time
from hybridkv.ops.compiled import compile_enabled
from hybridkv.sched.request import Sequence
from hybridkv.sched.sampling_params import SamplingParams

GREEDY = {"temperature": 0.0, "ignore_eos": True}


class Reply(NamedTuple):
    tokens: list[int]
    finish_reason: str | None
    cached: int  # prompt tokens served from the cache
    text: str
    stop_reason: int | str | None


def engine(path: Path, *, caching: bool = True, burst: int = 8, **options: Any) -> LLMEngine:
    if not ahead_of_time.available() or not compile_enabled():
        pytest.skip("packages are off here: no decode graph to burst through")
    return LLMEngine(
        EngineConfig(
            model=str(path),
            enable_prefix_caching=caching,
            decode_burst=burst,
            **{**OPTIONS, **options},
        )
    )


def run(llm: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, Reply]:
    """request id -> its reply; every streamed text is a prefix of the final one."""
    for request_id, (ids, params) in requests.items():
        llm.add_request(request_id, ids, params)
    replies: dict[str, Reply] = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            assert out.error is None, out.error
            done = out.outputs[0]
            replies[out.request_id] = Reply(
                list(done.token_ids),
                done.finish_reason,
                out.num_cached_tokens,
                done.text,
                done.stop_reason,
            )
    for reply in replies.values():
        assert reply.finish_reason is not None
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
        assert with_bursts[request_id].tokens == hf_greedy(hf, ids, params.max_tokens)[0]
    assert bursting.stats()["num_burst_forwards"] > 0
    assert single.stats()["num_burst_forwards"] == 0
    assert bursting.num_steps < single.num_steps


@pytest.mark.parametrize("rule", ["token", "string"])
def test_a_stop_inside_a_burst_ends_the_reply_there_and_nothing_past_it_is_cached(
    checkpoints: Any, rule: str
) -> None:
    """The reply stops at a stop token (or string) the burst ran past, with the text
    one-token steps give; a follow-up turn built on that reply hits the cache exactly as
    without bursts, and both equal transformers (a state or KV page from past the stop,
    if it were cached, would change its tokens)."""
    hf, path = checkpoints(ARCH)
    first = prompt(80, 30)
    free_run = run(engine(path, burst=1), {"f": (first, SamplingParams(max_tokens=20, **GREEDY))})
    tokens, text = free_run["f"].tokens, free_run["f"].text
    if rule == "token":
        at = next(i for i in range(3, 20) if tokens[i] not in tokens[:i])
        stop: dict[str, Any] = {"stop_token_ids": [tokens[at]]}
    else:
        at = next(i for i in range(3, len(text) - 1) if text.find(text[i : i + 2]) == i)
        stop = {"stop": [text[at : at + 2]]}
    params = SamplingParams(max_tokens=20, **stop, **GREEDY)
    replies = []
    for burst in (8, 1):
        llm = engine(path, burst=burst)
        reply = run(llm, {"t1": (first, params)})["t1"]
        follow_up = first + reply.tokens + prompt(81, 7)
        second = run(llm, {"t2": (follow_up, SamplingParams(max_tokens=12, **GREEDY))})["t2"]
        replies.append((reply, second))
        assert llm.stats()["num_burst_forwards"] > 0 or burst == 1
    assert replies[0] == replies[1]
    reply, second = replies[0]
    assert reply.finish_reason == "stop" and len(reply.tokens) < 20
    if rule == "token":
        assert reply.tokens == tokens[: at + 1]
    else:
        assert reply.text == text[:at] and tokens[: len(reply.tokens)] == reply.tokens
    assert second.cached > len(first)
    assert second.tokens == hf_greedy(hf, follow_up, 12)[0]


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
    for _ in range(3):  # the prefills, a plain decode round (it times a forward), a burst
        llm.step()
    assert llm.stats()["num_burst_forwards"] > 0
    late = prompt(110, 14)
    replies = run(llm, {"late": (late, SamplingParams(max_tokens=10, **GREEDY))})
    assert replies["late"].tokens == hf_greedy(hf, late, 10)[0]


class Round(NamedTuple):
    """A burst round: each chunk's request, forwards planned and forwards run."""

    names: list[str]
    planned: list[int]
    ran: list[int]


def burst_rounds(llm: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[Round]:
    """The engine's burst rounds, noted as they run."""
    rounds: list[Round] = []
    real = llm.runner.execute_burst

    def noted(chunks: Any, *args: Any, **kwargs: Any) -> BurstTokens:
        out = real(chunks, *args, **kwargs)
        names = [c.seq.request_id for c in chunks]
        rounds.append(Round(names, [1 + c.num_burst_tokens for c in chunks], out.widths))
        return out

    monkeypatch.setattr(llm.runner, "execute_burst", noted)
    return rounds


def stop_after(path: Path, ids: list[int], n: int) -> int:
    """A token of ``ids``' free-running greedy reply that first appears at its n-th token."""
    tokens = run(engine(path, burst=1), {"f": (ids, SamplingParams(max_tokens=20, **GREEDY))})
    reply = tokens["f"].tokens
    return next(reply[i] for i in range(n, 20) if reply[i] not in reply[:i])


def one_stops(
    path: Path, seed: int, stopper: str
) -> tuple[dict[str, list[int]], int, dict[str, tuple[list[int], SamplingParams]]]:
    """(prompts r0-r2 of 12 tokens, a stop token, the requests): 16 greedy tokens each,
    ``stopper`` also stopping at the token its reply first gives at its 6th (inside the
    second burst: 12 + 4 tokens, then 16)."""
    ids = {f"r{i}": prompt(seed + i, 12) for i in range(3)}
    stop = stop_after(path, ids[stopper], 6)
    requests = {
        name: (
            p,
            SamplingParams(
                max_tokens=16, **GREEDY, **({"stop_token_ids": [stop]} if name == stopper else {})
            ),
        )
        for name, p in ids.items()
    }
    return ids, stop, requests


def test_a_request_that_stops_leaves_the_burst_at_once_and_the_others_go_on(
    checkpoints: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nobody waits: a request whose token is one of its stop tokens gets no forward
    after it, the others burst on; replies equal one-token steps' and transformers'."""
    hf, path = checkpoints(ARCH)
    ids, stop, requests = one_stops(path, 130, "r1")
    bursting = engine(path, burst=16, decode_burst_budget_ms=None)
    rounds = burst_rounds(bursting, monkeypatch)
    timed: list[int] = []  # the burst rounds run before each time per forward is noted
    real_add = bursting._forward_times.add
    monkeypatch.setattr(
        bursting._forward_times, "add", lambda s: (timed.append(len(rounds)), real_add(s))
    )
    replies = run(bursting, requests)
    assert replies == run(engine(path, burst=1), requests)
    r1 = replies["r1"]
    assert r1.finish_reason == "stop" and r1.stop_reason == stop and len(r1.tokens) < 16
    for name in ("r0", "r2"):
        assert replies[name].tokens == hf_greedy(hf, ids[name], 16)[0]
    # the round r1 stopped in: its forwards end at its stop, the others' run as planned
    cut = [i for i, r in enumerate(rounds) if r.ran != r.planned]
    assert len(cut) == 1 and rounds[cut[0]].names == ["r0", "r1", "r2"]
    ran, planned = rounds[cut[0]].ran, rounds[cut[0]].planned
    assert ran[1] < planned[1] and ran[0] == planned[0] and ran[2] == planned[2]
    # its time per forward (fewer rows after the stop) is not taken as a full round's
    assert timed and cut[0] + 1 not in timed  # (the first round was timed, not the cut)


def test_a_stop_ends_the_burst_for_all_while_requests_wait_for_a_seat(
    checkpoints: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every seat taken and a request waiting: a stop inside a burst ends the round at
    that forward for every request (the freed seat is taken at the next round); the cut
    ones keep their tokens and go on, and every reply equals one-token steps' and
    transformers'."""
    hf, path = checkpoints(ARCH)
    ids, stop, requests = one_stops(path, 140, "r0")
    replies = {}
    for burst in (16, 1):
        llm = engine(path, burst=burst, max_num_seqs=2, decode_burst_budget_ms=None)
        rounds = burst_rounds(llm, monkeypatch)
        replies[burst] = run(llm, requests)
        if burst > 1:  # r0 and r1 burst while r2 waits: r0's stop ends the round for both
            cut = [r for r in rounds if r.ran != r.planned]
            assert len(cut) == 1 and cut[0].names == ["r0", "r1"]
            assert cut[0].ran[0] == cut[0].ran[1] < min(cut[0].planned)
    assert replies[16] == replies[1]
    assert replies[16]["r0"].finish_reason == "stop" and replies[16]["r0"].stop_reason == stop
    for name in ("r1", "r2"):
        assert replies[16][name].tokens == hf_greedy(hf, ids[name], 16)[0]


def test_a_stop_cuts_only_the_row_whose_own_stop_it_is() -> None:
    """After forward 2 of a burst whose batch holds chunks 0, 2 and 3 (1 left earlier):
    chunk 2's token is its stop, chunk 3's token is chunk 2's stop id but not its own."""
    widths = [5, 2, 5, 5]
    stops: list[Collection[int]] = [{7}, set(), {9}, {7}]
    chosen = torch.tensor([1, 9, 9])  # the rows of chunks 0, 2, 3
    _stop_at(2, chosen, torch.tensor([7, 9]), [0, 2, 3], stops, widths, False)
    assert widths == [5, 2, 3, 5]
    _stop_at(3, torch.tensor([7, 4]), torch.tensor([7, 9]), [0, 3], stops, widths, True)
    assert widths == [4, 2, 3, 4]  # chunk 0 stopped: the burst ends for all
    _stop_at(0, torch.tensor([4, 4]), torch.tensor([7, 9]), [0, 3], stops, widths, True)
    assert widths == [4, 2, 3, 4]  # no hit: nothing changes


def test_without_a_budget_a_burst_is_decode_burst_long() -> None:
    """``decode_burst_budget_ms=None`` (LLM's default): every burst ``decode_burst``
    forwards long, known forward time or not."""
    assert burst_length(16, None, None) == 16
    assert burst_length(16, 10.0, None) == 16
    assert burst_length(16, BURST_BUDGET_S / 3, BURST_BUDGET_S) == 3


@pytest.mark.parametrize("bad", [0, -1.0, "25", True, float("inf"), float("nan")])
def test_the_burst_budget_must_be_positive_or_none(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ValueError, match="decode_burst_budget_ms must be positive and finite"):
        EngineConfig(model=str(tmp_path), decode_burst_budget_ms=bad)


def test_the_offline_llm_bursts_without_a_budget_and_batches_4096_tokens(
    checkpoints: Any,
) -> None:
    """LLM's defaults (vLLM's CPU LLM class: 4096 tokens a step; nobody streams: bursts of
    16, no budget); given options win; the server's engine keeps 8 within 25 ms, 2048."""
    _, path = checkpoints(ARCH)
    llm = LLM(str(path), **OPTIONS)
    assert llm.engine.config.decode_burst_budget_ms is None
    assert llm.engine.config.decode_burst == 16
    assert llm.engine.scheduler.max_num_batched_tokens == 4096
    none = LLM(str(path), max_num_batched_tokens=None, **OPTIONS)  # None: this API's default
    assert none.engine.scheduler.max_num_batched_tokens == 4096
    given = LLM(str(path), decode_burst_budget_ms=10, max_num_batched_tokens=512, **OPTIONS)
    assert given.engine.config.decode_burst_budget_ms == 10
    assert given.engine.scheduler.max_num_batched_tokens == 512
    assert EngineConfig(model=str(path)).decode_burst_budget_ms == 25.0
    assert EngineConfig(model=str(path)).decode_burst == 8


def test_decode_burst_must_be_a_positive_integer(tmp_path: Path) -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="decode_burst must be a positive integer"):
            EngineConfig(model=str(tmp_path), decode_burst=bad)  # type: ignore[arg-type]


def test_a_forward_without_a_token_fails_its_request_after_the_tokens_before_it(
    checkpoints: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst forward whose logit is not finite (NaN logits): the tokens before it are
    the request's, then it fails, as one-token steps would give them and then fail; a
    stop among them ends it normally; its neighbour is unharmed."""
    hf, path = checkpoints(ARCH)
    llm = engine(path)
    real = llm.runner.execute_burst

    before: list[int] = []  # a's tokens before the burst that fails

    def third_forward_of_a_has_no_token(
        chunks: Any, manager: Any, *rest: Any, **options: Any
    ) -> BurstTokens:
        out = real(chunks, manager, *rest, **options)
        for i, chunk in enumerate(chunks):
            if chunk.seq.request_id == "a" and chunk.num_burst_tokens >= 2 and not before:
                before.append(chunk.seq.num_outputs)
                out.finite[i][2] = False
        return out

    monkeypatch.setattr(llm.runner, "execute_burst", third_forward_of_a_has_no_token)
    ids = {"a": prompt(120, 9), "b": prompt(121, 9)}
    for request_id, p in ids.items():
        llm.add_request(request_id, p, SamplingParams(max_tokens=12, **GREEDY))
    finals = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                finals[out.request_id] = out
    a, b = finals["a"], finals["b"]
    assert a.error is not None and "sampling failed" in a.error
    assert before and a.outputs[0].token_ids == hf_greedy(hf, ids["a"], before[0] + 2)[0]
    assert b.error is None and b.outputs[0].token_ids == hf_greedy(hf, ids["b"], 12)[0]


def plain_seq(name: str, prompt_len: int, max_tokens: int | None) -> Sequence:
    seq = Sequence(
        seq_id=ReqId(name),
        request_id=name,
        index=0,
        prompt_token_ids=list(range(prompt_len)),
        params=SamplingParams(max_tokens=max_tokens, **GREEDY),
    )
    seq.num_computed = prompt_len - 1  # decoding
    return seq


def test_plan_burst_stops_at_the_limits_and_bursts_all_or_none() -> None:
    near_end, long_one, short_context = (
        plain_seq("a", 10, 12),
        plain_seq("b", 10, None),
        plain_seq("c", 95, None),
    )
    seqs = [near_end, long_one, short_context]
    plan_burst(seqs, 8, 100, lambda s: True)
    # a: 12 outputs to go, b: no limit but the burst, c: 5 tokens to max_model_len
    assert [s.num_burst_tokens for s in seqs] == [7, 7, 4]
    near_end.output_token_ids = [1] * 10  # 2 outputs left
    near_end.num_computed = near_end.num_tokens - 1
    plan_burst(seqs, 8, 100, lambda s: True)
    assert [s.num_burst_tokens for s in seqs] == [1, 7, 4]
    plan_burst(seqs, 8, 100, lambda s: s is not long_one)  # one is not plain greedy
    assert [s.num_burst_tokens for s in seqs] == [0, 0, 0]
    plan_burst(seqs, 8, 100, lambda s: True)
    long_one.num_computed -= 1  # one prefills: nobody bursts, what they had is gone
    plan_burst(seqs, 8, 100, lambda s: True)
    assert [s.num_burst_tokens for s in seqs] == [0, 0, 0]


def test_a_burst_runs_the_forwards_that_fit_in_its_time_budget() -> None:
    """A round's burst is as long as the budget allows at the last decode round's time per
    forward (a short forward: the whole decode_burst; one near the budget: a plain step),
    and a plain step while that time is unknown."""
    assert burst_length(8, None) == 1
    assert burst_length(8, BURST_BUDGET_S / 100) == 8
    assert burst_length(8, BURST_BUDGET_S / 3) == 3
    assert burst_length(8, BURST_BUDGET_S * 2) == 1
    assert burst_length(1, BURST_BUDGET_S / 100) == 1


def test_one_slow_round_does_not_shorten_the_next_bursts() -> None:
    """The burst's length follows the median of the recent rounds' time per forward: a
    round slowed by another process does not cut the next bursts short; a lasting change
    is followed within a few rounds."""
    times = ForwardTimes(keep=5)
    assert times.typical is None
    usual = BURST_BUDGET_S / 10
    for _ in range(4):
        times.add(usual)
    times.add(usual * 5)  # one slow round
    assert burst_length(8, times.typical) == 8
    for _ in range(2):
        times.add(usual * 5)  # slower from now on
    assert burst_length(8, times.typical) == 2

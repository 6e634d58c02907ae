"""Trace generators are seeded; the trace file round-trips and rejects bad input clearly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hybridkv.sim.traces import TraceError, load_trace, parse_trace, random_tokens, save_trace
from hybridkv.sim.workloads import (
    TRACE_KINDS,
    ChatWorkload,
    builtin_trace,
    chat_trace,
)


@pytest.mark.parametrize("kind", TRACE_KINDS)
def test_generated_traces_are_reproducible(kind: str) -> None:
    assert builtin_trace(kind, seed=3, scale=0.1) == builtin_trace(kind, seed=3, scale=0.1)
    assert builtin_trace(kind, seed=3, scale=0.1) != builtin_trace(kind, seed=4, scale=0.1)


def test_chat_turn_extends_the_previous_context() -> None:
    trace = chat_trace(ChatWorkload(num_conversations=2, turns=3, system_prompt_tokens=32))
    by_id = {r.req_id: r for r in trace.requests}
    second, third = by_id["c1-t1"], by_id["c1-t2"]
    assert third.after == "c1-t1" and by_id["c1-t0"].after is None
    context = second.prompt_token_ids + second.output_token_ids
    assert third.prompt_token_ids[: len(context)] == context
    assert len(third.prompt_token_ids) > len(context)
    assert by_id["c0-t0"].prompt_token_ids[:32] == by_id["c1-t0"].prompt_token_ids[:32]


def test_saved_trace_loads_back_equal(tmp_path: Path) -> None:
    trace = builtin_trace("chat", scale=0.05)
    save_trace(trace, tmp_path / "t.json")
    assert load_trace(tmp_path / "t.json") == trace


def test_random_prompts_and_output_counts_expand_deterministically() -> None:
    doc = {
        "meta": {"vocab_size": 50},
        "requests": [
            {"id": "a", "prompt": {"random": {"len": 20, "seed": 7}}, "num_output_tokens": 5},
            {"id": "b", "after": "a", "think_steps": 2, "prompt_token_ids": [1, 2],
             "output_token_ids": [3]},
        ],
    }  # fmt: skip
    first, second = parse_trace(doc), parse_trace(json.loads(json.dumps(doc)))
    assert first == second
    a = first.requests[0]
    assert a.prompt_token_ids == random_tokens(20, 7, 50)
    assert len(a.output_token_ids) == 5 and all(t < 50 for t in a.output_token_ids)
    assert first.requests[1].after == "a" and first.requests[1].think_steps == 2


def _doc(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"id": "r0", "prompt_token_ids": [1, 2, 3], "num_output_tokens": 2}
    base.update(fields)
    return {"requests": [base]}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([], "JSON object"),
        ({"requests": []}, "non-empty list"),
        (_doc(id=""), "'id' must be a non-empty string"),
        (_doc(after="r9"), "'after' must name a request listed earlier"),
        (_doc(arrival=-1), "'arrival' must be a non-negative integer"),
        (_doc(think_steps=1.5), "'think_steps' must be a non-negative integer"),
        (_doc(prompt_token_ids=[]), "'prompt_token_ids' must be a non-empty list"),
        (_doc(prompt_token_ids=[1, "x"]), "not a token id"),
        (_doc(num_output_tokens=0), "'num_output_tokens' must be at least 1"),
        ({"requests": [{"id": "r0", "num_output_tokens": 1}]}, "needs 'prompt_token_ids'"),
        ({"requests": [{"id": "r0", "prompt_token_ids": [1]}]}, "needs 'output_token_ids'"),
        ({"meta": {"vocab_size": 0}, **_doc()}, "vocab_size"),
    ],
)
def test_invalid_traces_name_the_problem(doc: Any, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        parse_trace(doc)


def test_duplicate_ids_are_rejected() -> None:
    doc = _doc()
    doc["requests"].append(dict(doc["requests"][0]))
    with pytest.raises(TraceError, match=r"requests\[1\] \(id 'r0'\): duplicate id"):
        parse_trace(doc)


def test_unreadable_files_give_one_line_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TraceError, match="not valid JSON"):
        load_trace(bad)
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "missing.json")

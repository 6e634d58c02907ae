"""Structured output in the engine: the grammar mask per sequence, exact where it allows.

A masked greedy step must pick transformers' argmax among the allowed tokens (so where the
grammar allows the model's own argmax, output equals plain greedy); matchers must survive
preemption and n > 1; every kind of grammar must hold; bad grammars fail up front.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import torch
from engine_checkpoints import ARCH, OPTIONS, tight_cache_gib
from hybrid_checks import prompt
from tiny import hf_logits

from hybridkv.engine import LLM, SamplingParams
from hybridkv.sched.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


LARK = 'start: "yes" | "no" " " NUM\nNUM: /[0-9]/'


def structured(**fields: Any) -> StructuredOutputsParams:
    return StructuredOutputsParams(**fields)


def test_masked_greedy_is_transformers_argmax_among_allowed(llm: LLM, checkpoints: Any) -> None:
    hf, _ = checkpoints(ARCH)
    so = structured(json=SCHEMA)
    ids = prompt(3, 20)
    params = SamplingParams(temperature=0, max_tokens=80, structured_outputs=so)
    [out] = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    tokens = out.outputs[0].token_ids
    jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    logits = hf_logits(hf, ids + tokens)[len(ids) - 1 :]  # row i predicts output token i
    replay = llm.engine.structured.compile(so).matcher()
    agreed_with_plain = 0
    for i, token in enumerate(tokens):
        allowed = replay.allowed()
        masked = logits[i].masked_fill(~allowed, float("-inf"))
        assert token == int(torch.argmax(masked)), f"step {i}"
        agreed_with_plain += token == int(torch.argmax(logits[i]))
        replay.accept(token)
    assert replay.is_finished and out.outputs[0].finish_reason == "stop"
    print(f"{agreed_with_plain}/{len(tokens)} steps the mask allowed the plain argmax")


def test_matchers_survive_preemption_and_n(checkpoints: Any) -> None:
    """Seeded n=3 completions with a schema under a cache so small that sequences are
    preempted: same tokens as with room, each one valid."""
    _, path = checkpoints(ARCH)
    options = {**OPTIONS, "max_model_len": 160, "block_size": 8}
    roomy = LLM(str(path), **options)
    tight = LLM(str(path), **{**options, "cache_memory_gib": tight_cache_gib(path, options)})
    prompts = [{"prompt_token_ids": prompt(40 + i, 48)} for i in range(4)]
    params = SamplingParams(n=3, seed=5, max_tokens=100, structured_outputs=structured(json=SCHEMA))
    expected = roomy.generate(prompts, params, use_tqdm=False)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.stats()["num_preemptions"] > 0
    for a, b in zip(expected, got, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for c in b.outputs:
            jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len({c.text for c in got[0].outputs}) > 1  # the three samples differ


@pytest.mark.parametrize(
    ("fields", "check"),
    [
        ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        ({"regex": r"[a-c]{2,4}-[0-9]{2}"}, lambda t: re.fullmatch(r"[a-c]{2,4}-[0-9]{2}", t)),
        ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
        ({"grammar": LARK}, lambda t: t == "yes" or re.fullmatch("no [0-9]", t)),
    ],
    ids=["choice", "regex", "json_object", "lark"],
)  # fmt: skip
def test_every_kind_of_grammar_holds(llm: LLM, fields: dict[str, Any], check: Any) -> None:
    params = SamplingParams(n=4, seed=1, max_tokens=60, structured_outputs=structured(**fields))
    [out] = llm.generate("Answer:", params, use_tqdm=False)
    for c in out.outputs:
        if "json_object" in fields and c.finish_reason == "length":
            continue  # an unbounded object may not close within max_tokens
        assert check(c.text), c.text


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"json": {"type": "nonsense"}}, "invalid structured output"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"regex": "[0-9"}, "invalid structured output"),
        ({"grammar": "start: undefined_rule"}, "invalid structured output"),
    ],
)
def test_bad_grammars_fail_before_anything_runs(
    llm: LLM, fields: dict[str, Any], words: str
) -> None:
    params = SamplingParams(structured_outputs=structured(**fields))
    with pytest.raises(ValueError, match=words):
        llm.generate("x", params, use_tqdm=False)
    assert llm.stats()["num_waiting"] == 0


def test_structured_outputs_params_need_exactly_one_kind() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])

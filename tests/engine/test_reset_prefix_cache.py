"""``LLM.reset_prefix_cache()`` (vLLM's name): afterwards nothing computed before hits,
every page is free or held by a running request, and running requests go on unaffected:
their outputs equal caching off and transformers' greedy."""

from __future__ import annotations

from typing import Any

from engine_checkpoints import ARCH
from hybrid_checks import prompt
from test_engine_equivalence import assert_all_released, assert_transformers_greedy

from hybridkv import LLM, SamplingParams
from hybridkv.engine.outputs import RequestOutput

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
OPTIONS: dict[str, Any] = {
    "max_model_len": 256,
    "block_size": 8,
    "cache_memory_gib": 0.05,
    "poison_cache": True,
}


def generate(llm: LLM, prompt_ids: list[int]) -> RequestOutput:
    [out] = llm.generate([{"prompt_token_ids": prompt_ids}], GREEDY, use_tqdm=False)
    return out


def assert_nothing_cached(llm: LLM) -> None:
    llm.engine.manager.check_integrity()
    stats = llm.stats()
    assert all(g["pages_cached"] == 0 for g in stats["groups"]), stats["groups"]


def test_after_a_reset_nothing_hits_and_every_page_is_free(checkpoints: Any) -> None:
    hf, path = checkpoints(ARCH)
    llm = LLM(str(path), **OPTIONS)
    p = prompt(7, 45)
    cold, warm = generate(llm, p), generate(llm, p)
    assert (cold.num_cached_tokens, warm.num_cached_tokens) == (0, 40)  # its prompt end
    assert llm.reset_prefix_cache() is True
    assert_nothing_cached(llm)
    stats = llm.stats()
    assert stats["free_chunks"] == stats["num_chunks"] and stats["kv_cache_usage"] == 0
    again = generate(llm, p)
    assert again.num_cached_tokens == 0  # the reset forgot it: a cold turn again
    assert generate(llm, p).num_cached_tokens == 40  # and caching works on after it
    reply = cold.outputs[0].token_ids
    assert warm.outputs[0].token_ids == again.outputs[0].token_ids == reply
    assert_transformers_greedy(hf, p, reply)
    assert_all_released(llm)


def test_running_requests_are_unaffected(checkpoints: Any) -> None:
    """A request that resumed from a snapshot and is decoding when the cache is reset keeps
    its live pages (only those stay held) and finishes with caching off's reply."""
    hf, path = checkpoints(ARCH)
    llm = LLM(str(path), **OPTIONS)
    system = prompt(101, 64)
    generate(llm, system + prompt(1, 9))
    generate(llm, system + prompt(2, 9))  # snapshots the shared system prompt's end
    p = system + prompt(3, 9)
    engine = llm.engine
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine.add_request("running", {"prompt_token_ids": p}, params)
    out = None
    while out is None or len(out.outputs[0].token_ids) < 5:
        [out] = engine.step()
    assert out.num_cached_tokens == 64
    held = {g["group_id"]: g["pages_used"] for g in llm.stats()["groups"]}
    assert llm.reset_prefix_cache()
    assert_nothing_cached(llm)
    stats = llm.stats()
    for group in stats["groups"]:  # all free or live: the running request's pages only
        live = 1 if group["group_id"] in engine.manager.state_groups else held[group["group_id"]]
        assert group["pages_used"] == live, group
    while not out.finished:
        [out] = engine.step()
    off = LLM(str(path), enable_prefix_caching=False, **OPTIONS)
    [ref] = off.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert_transformers_greedy(hf, p, out.outputs[0].token_ids)
    assert_all_released(llm)

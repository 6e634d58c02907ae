"""Prefix caching never changes an answer: cache on == cache off == transformers' greedy.

Every architecture the models support runs the same multi-turn scenario on a tiny random
checkpoint: two conversations sharing a system prompt, three turns each (each turn's prompt
is the previous prompt + the reply + a new message), and a prompt repeated verbatim. The
rounds are submitted so that reuse is possible: the second conversation starts after the
first one has cached the system prompt (with a 16-token checkpoint interval, so recurrent
state snapshots are taken inside prefill chunks, during the forward). With the default
snapshots (no interval), users behind a shared system prompt exercise branch points: the
second user snapshots where the shared prefix ends, inside its prefill, and later ones
resume there (issue 12).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from engine_checkpoints import ARCH, ARCHITECTURES, tight_cache_gib
from hybrid_checks import prompt
from tiny import hf_logits

from hybridkv import LLM, SamplingParams
from hybridkv.core.checkpoint import CheckpointPolicy
from hybridkv.engine.config import EngineConfig
from hybridkv.layers import packed_linear
from hybridkv.layers.fp32_matmul import Fp32Linear
from hybridkv.layers.gated_deltanet import GatedDeltaNet
from hybridkv.ops import ahead_of_time, compiled
from hybridkv.ops.gated_delta_rule import mixer_decode
from hybridkv.ops.paged_attention import batched as attention_batched

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SYSTEM = prompt(100, 37)
OPTIONS: dict[str, Any] = {
    "max_model_len": 256,
    "block_size": 8,
    "checkpoint_interval": 16,
    "cache_memory_gib": 0.05,
    "poison_cache": True,
}

DEFAULTS = {k: v for k, v in OPTIONS.items() if k != "checkpoint_interval"}  # branch points


def run_scenario(llm: LLM) -> list[tuple[list[int], list[int], int]]:
    """(prompt, completion, num_cached_tokens) of every request, in submission order."""
    convs = {"a": SYSTEM + prompt(1, 9), "b": SYSTEM + prompt(2, 12)}
    repeat = prompt(3, 29)
    rounds: list[list[str]] = [["a", "repeat"], ["b", "a", "repeat"], ["a", "b"], ["b"]]
    results = []
    turn = {"a": 0, "b": 0}
    for names in rounds:
        prompts = [repeat if n == "repeat" else convs[n] for n in names]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        for name, p, out in zip(names, prompts, outs, strict=True):
            reply = out.outputs[0].token_ids
            assert len(reply) == MAX_TOKENS and out.outputs[0].finish_reason == "length"
            results.append((p, reply, out.num_cached_tokens))
            if name != "repeat":
                turn[name] += 1
                convs[name] = p + reply + prompt(10 * turn[name] + len(name), 5)
    return results


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_multiturn_cache_on_equals_off_equals_transformers(arch: str, checkpoints: Any) -> None:
    hf, path = checkpoints(arch)
    on = LLM(str(path), **OPTIONS)
    off = LLM(str(path), enable_prefix_caching=False, **OPTIONS)
    with_cache, without = run_scenario(on), run_scenario(off)
    for (p, reply, _), (p_off, reply_off, cached_off) in zip(with_cache, without, strict=True):
        assert p == p_off and reply == reply_off
        assert cached_off == 0
        assert_transformers_greedy(hf, p, reply)
    cached = [c for _, _, c in with_cache]
    # round 1: a, repeat (cold); round 2: b (system prompt), a turn 2, repeat (whole prompt)
    assert cached[:2] == [0, 0]
    assert cached[2] >= 32  # b found the 32-token checkpoint inside the shared system prompt
    assert all(c > 0 for c in cached[2:])
    assert cached[4] == (len(with_cache[4][0]) - 1) // 8 * 8  # the repeat: its prompt end
    stats = on.stats()
    assert stats["prefix_cache_hits"] == sum(cached) > 0
    assert stats["prefix_cache_queries"] == sum(len(p) for p, _, _ in with_cache)
    assert off.stats()["prefix_cache_hits"] == 0
    assert_all_released(on)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_packed_weights_keep_every_answer(
    arch: str, checkpoints: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every linear pre-packed for oneDNN (the tiny models' weights are all below the size
    packed by default, so the threshold is lowered to 0): the multi-turn scenario with the
    cache on gives transformers' greedy answers, the same as plain weights with it off."""
    hf, path = checkpoints(arch)
    plain = run_scenario(LLM(str(path), enable_prefix_caching=False, **OPTIONS))
    monkeypatch.setattr(
        packed_linear, "MIN_PACKED_ELEMENTS", dict.fromkeys(packed_linear.MIN_PACKED_ELEMENTS, 0)
    )
    llm = LLM(str(path), pack_weights=True, **OPTIONS)
    assert any(isinstance(m, packed_linear.PackedLinear) for m in llm.engine.runner.model.modules())
    packed = run_scenario(llm)
    for (p, reply, _), (_, reply_plain, cached_plain) in zip(packed, plain, strict=True):
        assert reply == reply_plain and cached_plain == 0
        assert_transformers_greedy(hf, p, reply)
    assert sum(c for _, _, c in packed) > 0  # the packed run was served from the cache
    assert_all_released(llm)


@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3_next"])
def test_enforce_eager_keeps_every_answer(
    arch: str, checkpoints: Any, monkeypatch: pytest.MonkeyPatch, just_in_time: None
) -> None:
    """``enforce_eager`` (the GDN mixer's decode step then runs eagerly instead of
    compiled, hybridkv.ops.compiled): the multi-turn scenario with the cache on gives the
    same greedy answers as the compiled engine, and transformers'; an engine beside it in
    the process still compiles."""
    hf, path = checkpoints(arch)
    with_compile = run_scenario(LLM(str(path), **OPTIONS))
    op = mixer_decode._mixer_decode
    assert op._compiled is not None and not op._failed
    ran: list[bool] = []
    real = op.eager

    def eager_spy(*args: Any) -> Any:
        ran.append(compiled.compile_enabled())
        return real(*args)

    monkeypatch.setattr(op, "eager", eager_spy)  # what compiled stays the real function
    compiled_llm = LLM(str(path), **OPTIONS)
    eager = run_scenario(LLM(str(path), enforce_eager=True, **OPTIONS))
    assert ran and not any(ran)  # every decode step of that engine ran eagerly
    ran.clear()
    assert run_scenario(compiled_llm) == with_compile and not ran  # this one compiled
    for (p, reply, cached), (_, reply_compiled, cached_compiled) in zip(
        eager, with_compile, strict=True
    ):
        assert reply == reply_compiled and cached == cached_compiled
        assert_transformers_greedy(hf, p, reply)


@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3_next"])
def test_serving_compiles_nothing_after_start_up(
    arch: str, checkpoints: Any, just_in_time: None
) -> None:
    """The engine compiles its compiled ops when it starts (ModelRunner.warm_up_compiled):
    the multi-turn scenario (batches of one and more, prefills beside decodes) then runs
    the compiled graph and compiles no other, so no request waits for a compile."""
    hf, path = checkpoints(arch)
    op = mixer_decode._mixer_decode
    torch._dynamo.reset()  # nothing compiled earlier in the process counts
    op.reset()
    llm = LLM(str(path), **OPTIONS)
    graphs, calls = torch._dynamo.utils.counters["stats"]["unique_graphs"], op.num_compiled_calls
    modules = llm.engine.runner.model.modules()
    assert calls == sum(isinstance(m, GatedDeltaNet) for m in modules)  # one warm-up each
    for p, reply, _ in run_scenario(llm):
        assert_transformers_greedy(hf, p, reply)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert op.num_compiled_calls > calls


def test_bf16_decodes_padded_to_a_key_multiple_keep_every_answer(
    checkpoints: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 decodes pad their key columns to a multiple of 64 (masked, re-reading a key the
    request wrote; batched.decode_key_multiple): three requests of different lengths
    decoding across a multiple (widths 64 -> 128), prefix caching on and the cache poisoned
    with NaN, give the same greedy tokens as with exact widths."""
    _, path = checkpoints("qwen3_next")
    prompts = [{"prompt_token_ids": prompt(60 + i, 20 + 7 * i)} for i in range(3)]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    options = {**OPTIONS, "dtype": "bfloat16"}
    padded = LLM(str(path), **options).generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(attention_batched, "MATMUL_DECODE_KEY_MULTIPLE", 1)
    exact = LLM(str(path), **options).generate(prompts, params, use_tqdm=False)
    for a, b in zip(padded, exact, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize("arch", ["qwen3_next", "nemotron_h"])  # GDN + MoE, Mamba2 + MoE
def test_bf16_with_fp32_matmuls_cache_on_equals_off_equals_transformers(
    arch: str, checkpoints: Any
) -> None:
    """A bf16 model whose matmuls run in fp32 (``cpu_matmul_dtype="float32"``, what "auto"
    picks on a CPU that emulates bf16 matmuls): the multi-turn scenario gives the same
    greedy replies with caching on and off, and transformers' in bf16 (teacher forcing, up
    to bf16 ties). The SSM states are kept in fp32: a bf16 state page rounds the state
    where a snapshot is taken, so a request resumed there departs by that rounding from
    one computed straight through, whatever the matmuls (with bf16 states this scenario's
    qwen3_next replies differ between caching on and off, bf16 matmuls or fp32)."""
    hf, path = checkpoints(arch)
    options = {**OPTIONS, "dtype": "bfloat16", "cpu_matmul_dtype": "float32"}
    options["mamba_ssm_cache_dtype"] = "float32"  # see the docstring
    on = LLM(str(path), **options)
    assert any(isinstance(m, Fp32Linear) for m in on.engine.runner.model.modules())
    off = LLM(str(path), enable_prefix_caching=False, **options)
    with_cache, without = run_scenario(on), run_scenario(off)
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    for (p, reply, _), (p_off, reply_off, _) in zip(with_cache, without, strict=True):
        assert p == p_off and reply == reply_off
        assert_transformers_greedy_in_bf16(hf16, p, reply)
    assert sum(c for _, _, c in with_cache) > 0


@pytest.mark.parametrize("packed", [False, True])
def test_bf16_moe_through_the_graphs_gives_transformers_greedy_replies(
    packed: bool, checkpoints: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bf16 Qwen3-Next with bf16 matmuls, whose sparse MoE layers run inside the
    decode and prefill graphs, its weights plain or packed for oneDNN (thresholds lowered
    to 0, so every linear and expert is called by handle): with caching on and off, every
    reply of the multi-turn scenario is transformers' greedy choice in bf16 up to bf16 ties
    (teacher forcing), and the cached run was served from the cache. Not on == off token
    for token: a decode's bits differ between the graph and a mixed step's eager forward
    (decode_graph's module doc), and bf16 turns that into different near-ties."""
    if packed and not packed_linear.can_pack(torch.bfloat16):
        pytest.skip("oneDNN cannot pack bf16 on this CPU (AVX2 alone)")
    if packed:
        zero = dict.fromkeys(packed_linear.MIN_PACKED_ELEMENTS, 0)
        monkeypatch.setattr(packed_linear, "MIN_PACKED_ELEMENTS", zero)
    hf, path = checkpoints("qwen3_next")
    options = {**OPTIONS, "dtype": "bfloat16", "cpu_matmul_dtype": "model"}
    options["mamba_ssm_cache_dtype"] = "float32"
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    for caching in (True, False):
        llm = LLM(str(path), enable_prefix_caching=caching, pack_weights=packed, **options)
        runner = llm.engine.runner
        if compiled.compile_enabled() and ahead_of_time.available():
            assert runner.decode_graph is not None  # the graphs know every piece
        modules = list(runner.model.modules())
        assert any(isinstance(m, packed_linear.PackedLinear) for m in modules) == packed
        results = run_scenario(llm)
        for p, reply, _ in results:
            assert_transformers_greedy_in_bf16(hf16, p, reply)
        assert (sum(c for _, _, c in results) > 0) == caching


BF16_TIE = 0.25  # logits closer than this are a tie in bf16 (two runs differ up to ~0.15)


def assert_transformers_greedy_in_bf16(hf16: Any, prompt_ids: list[int], reply: list[int]) -> None:
    """:func:`assert_transformers_greedy` against transformers in bf16, whose own rounding
    differs from ours by up to ~0.15 in a logit (tests/models/test_loader.py): each reply
    token is transformers' argmax, or within :data:`BF16_TIE` of it."""
    logits = hf_logits(hf16, prompt_ids + reply).float()
    n = len(prompt_ids)
    rows = logits[n - 1 : n - 1 + len(reply)]
    chosen = rows.gather(1, torch.tensor(reply)[:, None])[:, 0]
    gaps = rows.max(dim=-1).values - chosen
    assert float(gaps.max()) <= BF16_TIE, (gaps.tolist(), reply)


@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3_next"])
def test_parallel_samples_decode_each_on_its_own_state(
    arch: str, checkpoints: Any, monkeypatch: pytest.MonkeyPatch, just_in_time: None
) -> None:
    """n = 3 greedy samples of one prompt decode together in the compiled GDN step, which
    updates each page in place and so needs every row's state on a page of its own (a
    shared page would be updated three times a step): no decode batch lists a page twice,
    and each sample equals the n = 1 reply and transformers'."""
    hf, path = checkpoints(arch)
    op = mixer_decode._mixer_decode
    batches: list[list[int]] = []

    class Checked:  # the op, recording each batch's pages
        def __getattr__(self, name: str) -> Any:
            return getattr(op, name)

        def __call__(self, *args: Any) -> Any:
            batches.append(args[4].tolist())  # the decodes' pages
            return op(*args)

    monkeypatch.setattr(mixer_decode, "_mixer_decode", Checked())
    llm = LLM(str(path), **DEFAULTS)
    ids = prompt(77, 30)
    single = llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)[0]
    params = SamplingParams(n=3, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    [out] = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    reply = single.outputs[0].token_ids
    assert [c.token_ids for c in out.outputs] == [reply] * 3
    assert_transformers_greedy(hf, ids, reply)
    assert any(len(b) >= 3 for b in batches)  # the samples decoded together
    assert all(len(set(b)) == len(b) for b in batches)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_users_behind_a_system_prompt_hit_its_branch_point(arch: str, checkpoints: Any) -> None:
    """Default snapshots, a 100-token system prompt (issue 12: three users got 0/0/0 cached
    tokens): the first user caches its KV only; the second finds it shared and snapshots
    its end (96 = 12 blocks of 8) inside its own prefill chunk; the third and fourth resume
    there. Outputs equal cache off and transformers."""
    assert users_behind_a_system_prompt(*checkpoints(arch)) == [0, 0, 96, 96]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_users_arriving_together_behind_a_system_prompt_compute_it_once(
    arch: str, checkpoints: Any
) -> None:
    """Four users submitted at once behind a 100-token system prompt (issue 13's W3 in
    small): the first snapshots where their prompts branch (96), the others wait for it and
    resume there. Outputs equal cache off and transformers."""
    hf, path = checkpoints(arch)
    system = prompt(101, 100)
    prompts = [{"prompt_token_ids": system + prompt(40 + i, 9 + i)} for i in range(4)]
    on = LLM(str(path), **DEFAULTS)
    got = on.generate(prompts, GREEDY, use_tqdm=False)
    ref = LLM(str(path), enable_prefix_caching=False, **DEFAULTS).generate(
        prompts, GREEDY, use_tqdm=False
    )
    for p, out, out_off in zip(prompts, got, ref, strict=True):
        assert out.outputs[0].token_ids == out_off.outputs[0].token_ids
        assert_transformers_greedy(hf, p["prompt_token_ids"], out.outputs[0].token_ids)
    assert [out.num_cached_tokens for out in got] == [0, 96, 96, 96]
    assert_all_released(on)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_prefill_grid_snapshots_equal_cache_off(
    arch: str, checkpoints: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefill grid (a prompt's state every ``prefill_grid_tokens``, 4096 by default, so
    it never fires on the tests' short prompts) shrunk to 40 tokens: the first user behind a
    100-token system prompt snapshots at 40 and 80 inside its prefill, so the second resumes
    at 80 (0 without the grid, as above) and snapshots the branch point (96) that the third
    and fourth resume at. Outputs equal cache off and transformers."""

    def grid_policy(config: EngineConfig) -> CheckpointPolicy:
        return CheckpointPolicy(
            interval_tokens=config.checkpoint_interval,
            retention_interval_tokens=config.retention_interval,
            prefill_grid_tokens=40,
        )

    monkeypatch.setattr(EngineConfig, "checkpoint_policy", property(grid_policy))
    assert users_behind_a_system_prompt(*checkpoints(arch)) == [0, 80, 96, 96]


@pytest.mark.parametrize("caching", [True, False], ids=["cache_on", "cache_off"])
def test_a_fresh_prompt_gets_its_first_token_in_one_step(caching: bool, checkpoints: Any) -> None:
    """Its prompt-end snapshot (40 of 45 tokens) is taken inside the forward: caching
    costs no step (before issue 12 the prefill was cut at 40, one step more)."""
    _, path = checkpoints(ARCH)
    engine = LLM(str(path), enable_prefix_caching=caching, **DEFAULTS).engine
    engine.add_request("r", {"prompt_token_ids": prompt(5, 45)}, GREEDY)
    [out] = engine.step()
    assert len(out.outputs[0].token_ids) == 1
    assert engine.num_steps == 1
    assert engine.manager.usage().snapshots_taken == (1 if caching else 0)


def users_behind_a_system_prompt(hf: Any, path: Any) -> list[int]:
    """Four users, one after another, behind a 100-token system prompt: each reply equals
    cache off's and transformers'; returns the cached tokens of each, with every page
    released at the end."""
    system = prompt(101, 100)
    on = LLM(str(path), **DEFAULTS)
    off = LLM(str(path), enable_prefix_caching=False, **DEFAULTS)
    cached = []
    for i in range(4):
        p = system + prompt(40 + i, 9 + i)
        [got] = on.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)
        [ref] = off.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        assert_transformers_greedy(hf, p, got.outputs[0].token_ids)
        cached.append(got.num_cached_tokens)
    assert_all_released(on)
    return cached


def assert_transformers_greedy(hf: Any, prompt_ids: list[int], reply: list[int]) -> None:
    """``reply`` is transformers' greedy continuation of ``prompt_ids``.

    One full forward over prompt + reply (teacher forcing): greedy generation produces
    ``reply`` exactly when every reply token is the argmax after the tokens before it.
    That is ten times cheaper than ``generate`` and checks the same thing.
    """
    logits = hf_logits(hf, prompt_ids + reply)
    n = len(prompt_ids)
    assert logits[n - 1 : n - 1 + len(reply)].argmax(dim=-1).tolist() == reply


def assert_all_released(llm: LLM) -> None:
    """After every request finished: no page held by a request; the cache is consistent."""
    manager = llm.engine.manager
    manager.check_integrity()
    assert manager.num_requests == 0
    for group in llm.stats()["groups"]:
        assert group["pages_used"] == 0, group


@pytest.mark.parametrize("snapshots", ["interval", "default"])
@pytest.mark.parametrize("arch", ["qwen3_next", "nemotron_h", "jamba"])  # GDN, Mamba2, Mamba1
def test_memory_pressure_preempts_and_evicts_without_changing_outputs(
    arch: str, snapshots: str, checkpoints: Any
) -> None:
    # Architectures whose tight arena runs out of KV pages while sequences decode, so running
    # sequences are preempted. (Where states are the scarce pages, e.g. bamba, new sequences
    # wait at admission instead, which is not preemption.)
    hf, path = checkpoints(arch)
    options = {**(OPTIONS if snapshots == "interval" else DEFAULTS), "max_model_len": 128}
    small = LLM(str(path), **{**options, "cache_memory_gib": tight_cache_gib(path, options)})
    shared = prompt(7, 24)
    prompts = [shared + prompt(20 + i, 30 + 3 * i) for i in range(8)] + [shared + prompt(20, 30)]
    requests = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in small.generate(requests, params, use_tqdm=False)]
    stats = small.stats()
    assert stats["num_preemptions"] > 0, stats
    assert stats["pages_evicted"] > 0, stats
    assert_all_released(small)
    for p, tokens in zip(prompts, got, strict=True):
        assert_transformers_greedy(hf, p, tokens)

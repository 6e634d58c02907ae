"""The whole-model prefill graph (hybridkv.models.prefill_graph) against the eager forward.

As tests/models/test_decode_graph.py: the tiny Qwen3.5 over a poisoned, scrambled arena
(tests/models/paged_runner.py), one step run both ways from the same bytes. The package is
built once per machine and shape (~1-2 min) into the user's package cache.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from hybrid_checks import assert_close, prompt
from paged_runner import PagedRunner
from test_decode_graph import (
    _rewinder,
    _views,
    assert_bf16_close,
    bf16_tiny,
    engines_on_and_off,
    generate,
    prefilled,
)
from tiny import hf_greedy, make_hf_model, save_checkpoint

from hybridkv.engine import EngineConfig, LLMEngine
from hybridkv.engine import runner as runner_module
from hybridkv.engine.runner import layer_heads, prefill_graph_calls
from hybridkv.layers.gated_deltanet import GatedDeltaNet
from hybridkv.models import prefill_graph
from hybridkv.models.loader import load_model
from hybridkv.models.prefill_graph import (
    MAX_TOKENS,
    PrefillGraph,
    load_prefill_graph,
    one_chunk_delta_rule,
)
from hybridkv.ops import ahead_of_time
from hybridkv.ops.compiled import compile_enabled
from hybridkv.ops.gated_delta_rule.naive import l2norm
from hybridkv.ops.paged_state import StateCaptures
from hybridkv.sched.sampling_params import SamplingParams

PREFIXES = {"a": prompt(41, 37), "b": prompt(42, 16)}


@pytest.fixture
def loaded(get_tiny: Any) -> tuple[PagedRunner, PrefillGraph]:
    """A runner with two requests prefilled eagerly, and the prefill graph over its arena."""
    return prefilled(get_tiny, load_prefill_graph, PREFIXES, seed=9)


def _snapshot_pages(runner: PagedRunner, count: int) -> list[int]:
    """``count`` free state pages of the recurrent group to capture into."""
    (group,) = [g.group_id for g in runner.spec.groups if g.is_recurrent]
    return [runner.allocator.allocate(group) for _ in range(count)]


def _prefill(
    runner: PagedRunner,
    graph: PrefillGraph | None,
    work: list[tuple[str, list[int]]],
    captures: list[tuple[int, int]] = (),  # type: ignore[assignment]
) -> torch.Tensor:
    """One step of prefill chunks ``work``: eager, or through ``graph``; the state after
    each ``(row of the step, page)`` of ``captures`` written to its page. Logits at each
    chunk's last token."""
    with torch.inference_mode():
        batch = runner.build_batch(work, all_logits=False)
        if captures:
            (group,) = [g.group_id for g in runner.spec.groups if g.is_recurrent]
            rows, pages = zip(*captures, strict=True)
            batch.state_captures = {group: StateCaptures(torch.tensor(rows), torch.tensor(pages))}
        last = batch.query_start_loc[1:] - 1
        batch.logits_indices = last
        if graph is None:
            logits = runner.model(batch, runner.views)
        else:
            width = graph.width(batch)
            assert width is not None
            logits = graph(batch, width)
    for req_id, tokens in work:
        runner.reqs[req_id].num_computed += len(tokens)
    return logits


def _both_ways(
    runner: PagedRunner,
    graph: PrefillGraph,
    work: list[tuple[str, list[int]]],
    captures: list[tuple[int, int]] = (),  # type: ignore[assignment]
    bf16: bool = False,
) -> None:
    """The step eagerly, then through the graph from the same bytes: the same logits, the
    same pages written to rounding (a bf16 model's), nothing else written (the NaN
    poison where it was)."""
    rewind = _rewinder(runner)
    eager = _prefill(runner, None, work, captures)
    eager_pages = _views(runner)
    rewind()
    got = _prefill(runner, graph, work, captures)
    assert torch.isfinite(got).all()
    if bf16:
        assert_bf16_close(got, eager, _views(runner), eager_pages)
        return
    assert_close(got, eager)
    for mine, theirs in zip(_views(runner), eager_pages, strict=True):
        assert torch.equal(mine.isnan(), theirs.isnan())
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-3, equal_nan=True)


def test_fresh_and_continued_prefills_of_unequal_lengths(
    loaded: tuple[PagedRunner, PrefillGraph],
) -> None:
    """A fresh request (a state page of NaN), two that continue from their states and
    keys, their lengths unequal (the shorter padded), in one step."""
    runner, graph = loaded
    work = [("fresh", prompt(44, 50)), ("a", prompt(43, 29)), ("b", prompt(45, 3))]
    _both_ways(runner, graph, work)


def test_chunks_shorter_than_the_conv_window(loaded: tuple[PagedRunner, PrefillGraph]) -> None:
    """Chunks of 2 tokens, fewer than the conv's 3 carried inputs: the carried ones shift
    in (a continued request) or start from zeros (a fresh one)."""
    runner, graph = loaded
    _both_ways(runner, graph, [("b", prompt(49, 2)), ("fresh", prompt(50, 2))])


def test_the_longest_chunk_the_graph_takes(loaded: tuple[PagedRunner, PrefillGraph]) -> None:
    """One chunk of MAX_TOKENS tokens: the recurrence as one chunk of them (the eager op
    steps 16 at a time), its states the same to rounding."""
    runner, graph = loaded
    _both_ways(runner, graph, [("a", prompt(46, MAX_TOKENS))])


def test_snapshots_taken_inside_the_graph(loaded: tuple[PagedRunner, PrefillGraph]) -> None:
    """States after rows inside the chunks, at their ends and in two requests at once go
    to their pages as the eager forward's captures put them."""
    runner, graph = loaded
    pages = _snapshot_pages(runner, 4)
    work = [("a", prompt(47, 40)), ("fresh", prompt(48, 33))]
    # rows of the flat step: a's 16th and last, fresh's 1st and last (a padded chunk's)
    captures = [(15, pages[0]), (39, pages[1]), (40, pages[2]), (72, pages[3])]
    _both_ways(runner, graph, work, captures)


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_moe_text"])
def test_sparse_moe_layers_prefill_as_the_eager_forward(
    get_tiny: Any, model_type: str, tmp_path: Path
) -> None:
    """The tiny MoE models in bf16: a fresh and a continued chunk of unequal lengths, their
    rows routed to every expert, through the graph's sorted expert layout."""
    lm = bf16_tiny(get_tiny, model_type, tmp_path)
    runner, graph = prefilled(get_tiny, load_prefill_graph, PREFIXES, 10, lm)
    _both_ways(runner, graph, [("fresh", prompt(51, 45)), ("a", prompt(52, 20))], bf16=True)


def test_an_engine_prefills_through_the_graph(tmp_path: Path, get_tiny: Any) -> None:
    """Caching on, a follow-up turn prefills its new tokens through the graph (snapshots
    inside it), hits what its previous turn left, and every reply equals caching off's
    (whose long first prompts run eagerly) and transformers' greedy tokens."""
    hf, on, off = engines_on_and_off(tmp_path, get_tiny, max_model_len=512)
    graph = on.runner.prefill_graph
    assert graph is not None
    first = prompt(51, 150)  # longer than the graph takes: eager
    replies, cached = [], []
    for engine in (on, off):
        calls = graph.step.num_calls  # (the engines share the loaded package)
        reply = generate(engine, "t1", first, 12)[0]
        assert graph.step.num_calls == calls  # the long prompt ran eagerly
        follow_up = first + reply + prompt(52, 40)
        reply2, hit2 = generate(engine, "t2", follow_up, 12)
        replies.append((reply, reply2))
        cached.append(hit2)
    assert replies[0] == replies[1]
    assert replies[0][0] == hf_greedy(hf, first, 12)[0]
    assert replies[0][1] == hf_greedy(hf, first + replies[0][0] + prompt(52, 40), 12)[0]
    assert cached[0] > len(first) and cached[1] == 0
    assert graph.step.num_calls > 0


def poisoned_engine(path: Path, caching: bool) -> tuple[LLMEngine, PrefillGraph]:
    """An engine of the checkpoint at ``path`` on a poisoned arena, and its prefill graph."""
    engine = LLMEngine(
        EngineConfig(
            model=str(path),
            cache_memory_gib=0.02,
            enable_prefix_caching=caching,
            poison_cache=True,
        )
    )
    graph = engine.runner.prefill_graph
    assert graph is not None
    return engine, graph


def test_a_snapshot_at_a_chunks_end_is_its_live_state_copied(
    tmp_path: Path, get_tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill chunk's snapshot after its last token (the 48-token prompt's state, a
    sequence end) is not a capture of the graph's: the runner copies the live page into it
    after the graph. A follow-up turn resumes from it (on a poisoned arena: a missed copy
    would read NaN), and its reply equals caching off's and transformers'."""
    if not ahead_of_time.available() or not compile_enabled():
        pytest.skip("packages are off here")
    hf, _ = get_tiny("qwen3_5_text")
    path = save_checkpoint(hf, tmp_path / "ckpt")
    first = prompt(53, 48)  # three whole blocks: snapshots at 32 (inside) and 48 (its end)
    follow_up_tail = prompt(54, 20)
    replies, cached = [], []
    for caching in (True, False):
        engine, graph = poisoned_engine(path, caching)
        captured: list[list[int]] = []  # the rows of the graph's captures, each call

        def run(
            *args: Any, graph: PrefillGraph = graph, captured: list[list[int]] = captured
        ) -> Any:
            captured.append([int(r) for rows, _ in args[6] for r in rows])
            return PrefillGraph.run(graph, *args)

        monkeypatch.setattr(graph, "run", run)
        reply = generate(engine, "t1", first, 1)[0]
        if caching:
            assert captured == [[31]]  # position 32 inside; 48's is a copy
        follow_up = first + reply + follow_up_tail
        reply2, hit = generate(engine, "t2", follow_up, 8)
        replies.append((reply, reply2))
        cached.append(hit)
    assert cached == [48, 0]
    assert replies[0] == replies[1]
    assert replies[0][1] == hf_greedy(hf, first + replies[0][0] + follow_up_tail, 8)[0]


def test_a_step_of_decodes_and_prefills_runs_both_graphs(
    tmp_path: Path, get_tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests arriving while others decode: steps that hold decodes and prefill chunks
    run both graphs, their logits put back in the step's order; every reply equals
    transformers' greedy tokens, caching on and off."""
    if not ahead_of_time.available() or not compile_enabled():
        pytest.skip("packages are off here")
    hf, _ = get_tiny("qwen3_5_text")
    path = save_checkpoint(hf, tmp_path / "ckpt")
    prompts = {f"r{i}": prompt(60 + i, 20 + 23 * i) for i in range(4)}
    for caching in (True, False):
        engine = LLMEngine(
            EngineConfig(model=str(path), cache_memory_gib=0.02, enable_prefix_caching=caching)
        )
        ran: list[str] = []  # the graphs each step ran
        for name in ("decode_graph", "prefill_graph"):
            graph = getattr(engine.runner, name)
            assert graph is not None
            monkeypatch.setattr(graph, "run", _noting(graph.run, ran, name[0]))
        replies: dict[str, list[int]] = {}
        pending = list(prompts.items())
        steps: list[str] = []
        while pending or engine.has_unfinished_requests():
            if pending:  # one more request every step: its prefill beside the decodes
                request_id, ids = pending.pop(0)
                engine.add_request(request_id, ids, SamplingParams(max_tokens=6, temperature=0))
            ran.clear()
            for out in engine.step():
                if out.finished:
                    replies[out.request_id] = list(out.outputs[0].token_ids)
            steps.append("".join(sorted(ran)))
        for request_id, ids in prompts.items():
            assert replies[request_id] == hf_greedy(hf, ids, 6)[0], request_id
        assert "dp" in steps, steps  # mixed steps
        assert any(set(s) == {"d"} for s in steps), steps  # then decodes alone (bursts)


def _noting(run: Any, ran: list[str], mark: str) -> Any:
    """``run``, noting ``mark`` in ``ran`` at each call."""

    def noted(*args: Any) -> Any:
        ran.append(mark)
        return run(*args)

    return noted


@pytest.mark.parametrize("decay", [1.0, 0.05])
def test_one_chunk_of_the_longest_prefill_holds_its_precision(decay: float) -> None:
    """The graph's recurrence as one chunk of MAX_TOKENS rows (the eager op's are 16), on a
    real model's head shapes (8 heads of 128 x 128), strong and weak decay: output and
    final state within 1e-5 of the token-by-token recurrence in fp64, relative to their
    size."""
    torch.manual_seed(0)
    rows, heads, dim = MAX_TOKENS, 8, 128
    q, k, v = (torch.randn(1, rows, heads, dim) for _ in range(3))
    g = -decay * torch.nn.functional.softplus(torch.randn(1, rows, heads))
    beta = torch.rand(1, rows, heads)
    start = torch.randn(1, heads, dim, dim) * 0.1
    q_normed, k_normed = l2norm(q) * dim**-0.5, l2norm(k)

    def heads_first(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).contiguous()

    operands = [heads_first(x) for x in (q_normed, k_normed, v, g, beta)]
    out, state, *_ = one_chunk_delta_rule(*operands, start)
    want_q, want_k, want_v, want_g, want_beta = (x.double() for x in operands)
    want_state = start.double()
    want_out = torch.empty_like(want_v)
    for t in range(rows):  # S = d S + k (beta (v - d S^T k))^T, o = S^T q, in fp64
        want_state = want_state * want_g[:, :, t].exp()[..., None, None]
        k_t = want_k[:, :, t]
        memory = (want_state * k_t[..., None]).sum(-2)
        delta = (want_v[:, :, t] - memory) * want_beta[:, :, t, None]
        want_state = want_state + k_t[..., None] * delta[..., None, :]
        want_out[:, :, t] = (want_state * want_q[:, :, t, :, None]).sum(-2)
    for got, want in ((out, want_out), (state, want_state)):
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_steps_past_the_score_budget_run_eagerly(
    tmp_path: Path, get_tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step whose attention scores would pass MAX_SCORES (long contexts) runs the eager
    forward, and its replies are transformers' all the same."""
    if not ahead_of_time.available() or not compile_enabled():
        pytest.skip("packages are off here")
    hf, _ = get_tiny("qwen3_5_text")
    path = save_checkpoint(hf, tmp_path / "ckpt")
    engine = LLMEngine(EngineConfig(model=str(path), cache_memory_gib=0.02))
    graph = engine.runner.prefill_graph
    assert graph is not None
    # each prompt one prefill chunk: 4 query heads x 60 tokens x 64 keys (4 pages of 16)
    first, second = prompt(70, 60), prompt(71, 60)
    monkeypatch.setattr(prefill_graph, "MAX_SCORES", 4 * 60 * 64 - 1)
    calls = graph.step.num_calls
    assert generate(engine, "past", first, 12)[0] == hf_greedy(hf, first, 12)[0]
    assert graph.step.num_calls == calls
    monkeypatch.setattr(prefill_graph, "MAX_SCORES", 4 * 60 * 64)
    assert generate(engine, "fits", second, 12)[0] == hf_greedy(hf, second, 12)[0]
    assert graph.step.num_calls > calls


def test_the_longest_chunk_is_the_models(get_tiny: Any) -> None:
    """The prefill graph takes chunks up to MAX_TOKENS on the tiny Qwen3.5 (its GDN rows
    are narrow: Hv x (Dk + Dv) = 4 x 28), up to 64 on GDN layers of the small Qwen3-Next's
    width (8 x 128), 8 on Qwen3-Next-80B's (32 x 256), and MAX_TOKENS without GDN layers;
    a chunk past it runs eagerly."""
    _, lm = get_tiny("qwen3_5_text")
    assert runner_module.prefill_graph_tokens(lm.model) == MAX_TOKENS == 128
    model = copy.deepcopy(lm.model)
    gdn = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    for widths, expected in [((8, 64, 64), 64), ((32, 128, 128), 8)]:
        heads, k_dim, v_dim = widths
        for m in gdn:
            m.cfg = dataclasses.replace(
                m.cfg, num_v_heads=heads, k_head_dim=k_dim, v_head_dim=v_dim
            )
        assert runner_module.prefill_graph_tokens(model) == expected
    assert runner_module.prefill_graph_tokens(torch.nn.Linear(2, 2)) == MAX_TOKENS


def test_heavy_models_prefill_in_one_call_and_short_contexts_only(get_tiny: Any) -> None:
    """The tiny Qwen3.5's weights are light (its prefill chunks run in L2-sized groups, any
    context); past LIGHT_WEIGHT_BYTES a model's step runs in one call of the graph, and a
    chunk whose context passes HEAVY_PREFILL_MAX_KEYS tokens runs eagerly."""
    _, lm = get_tiny("qwen3_5_text")
    assert runner_module.light_weights(lm.model)
    heavy = torch.nn.Linear(4096, runner_module.LIGHT_WEIGHT_BYTES // (4 * 4096) + 1)
    assert not runner_module.light_weights(heavy)
    runner = runner_module.ModelRunner.__new__(runner_module.ModelRunner)
    runner._prefill_graph_tokens = MAX_TOKENS

    class Chunk:
        num_draft_tokens = 0

        class allocation:
            scratch = ()

        def __init__(self, tokens: int, end: int) -> None:
            self.num_tokens, self.end = tokens, end

    keys = runner_module.HEAVY_PREFILL_MAX_KEYS
    for light, tokens, end, takes in [
        (True, 14, 1536, True),
        (False, 14, keys, True),
        (False, 14, keys + 1, False),
        (True, MAX_TOKENS + 1, MAX_TOKENS + 1, False),
    ]:
        runner._light_weights = light
        assert runner._takes_prefill(Chunk(tokens, end)) is takes  # type: ignore[arg-type]


def test_prefill_chunks_run_in_groups_that_fit_the_l2() -> None:
    """A group's intermediates (4 x requests x heads x its longest chunk x max(that, its
    most keys) bytes) stay within the budget: the tiny model's 48-token prompts 14 to a
    call; a long chunk over many keys runs alone without shrinking the others' groups; a
    chunk over the budget alone still runs."""
    per_request = 4 * 4 * 48 * 48
    assert runner_module.PREFILL_GROUP_BYTES // per_request == 14
    assert [len(g) for g in prefill_graph_calls([(48, 48)] * 64, 4)] == [14, 14, 14, 14, 8]
    sizes = [(48, 48)] * 20 + [(128, 4096)] + [(48, 48)] * 20
    groups = prefill_graph_calls(sizes, 4)
    assert [len(g) for g in groups] == [14, 6, 1, 14, 6]
    assert groups[2] == range(20, 21)  # the long one alone, in its place
    assert [i for g in groups for i in g] == list(range(41))  # every chunk once, in order
    assert prefill_graph_calls([(128, 8192)] * 2, 32) == [range(0, 1), range(1, 2)]
    assert prefill_graph_calls([(5, 16)], 4) == [range(0, 1)]


def test_the_most_heads_of_a_layer(tmp_path: Path, get_tiny: Any) -> None:
    """Attention's query heads or GDN's value heads, whichever a layer has more of."""
    _, lm = get_tiny("qwen3_5_text")
    assert layer_heads(lm.model) == 4  # 4 query heads, 4 value heads
    wide = make_hf_model("qwen3_5_text", linear_num_value_heads=8)
    assert layer_heads(load_model(save_checkpoint(wide, tmp_path), "float32").model) == 8


def in_twos(sizes: list[tuple[int, int]], heads: int) -> list[range]:
    return [range(i, min(i + 2, len(sizes))) for i in range(0, len(sizes), 2)]


def in_one(sizes: list[tuple[int, int]], heads: int) -> list[range]:
    return [range(len(sizes))]


def in_ones(sizes: list[tuple[int, int]], heads: int) -> list[range]:
    return [range(i, i + 1) for i in range(len(sizes))]


def test_a_steps_prefills_in_groups_equal_one_call(
    tmp_path: Path, get_tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seven prompts of unequal lengths prefilled in one step, caching on (snapshots inside
    and at the ends), on a poisoned arena: run in groups of two (each its own width) and in
    one call, their replies are the same and transformers'; a follow-up turn resumes from
    the end snapshot of a prompt in the second group."""
    if not ahead_of_time.available() or not compile_enabled():
        pytest.skip("packages are off here")
    hf, _ = get_tiny("qwen3_5_text")
    path = save_checkpoint(hf, tmp_path / "ckpt")
    prompts = {f"r{i}": prompt(80 + i, 17 + 7 * i) for i in range(7)}  # 17 .. 59 tokens
    prompts["r3"] = prompt(83, 48)  # its end snapshot (48) a copy after its group's call
    replies: dict[bool, dict[str, list[int]]] = {}
    for grouped in (True, False):
        engine, graph = poisoned_engine(path, caching=True)
        calls: list[tuple[int, int]] = []  # (requests, width) of each call

        def run(*args: Any, graph: PrefillGraph = graph, calls: list = calls) -> Any:
            calls.append(tuple(args[0].shape))
            return PrefillGraph.run(graph, *args)

        monkeypatch.setattr(graph, "run", run)
        monkeypatch.setattr(runner_module, "prefill_graph_calls", in_twos if grouped else in_one)
        for request_id, ids in prompts.items():
            engine.add_request(request_id, ids, SamplingParams(max_tokens=5, temperature=0))
        replies[grouped] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    replies[grouped][out.request_id] = list(out.outputs[0].token_ids)
        if grouped:  # the groups' widths: their longest prompts'
            assert calls == [(2, 24), (2, 48), (2, 52), (1, 59)]
            follow_up = prompts["r3"] + replies[True]["r3"] + prompt(90, 9)
            reply, hit = generate(engine, "t2", follow_up, 5)
            assert hit == 48  # r3's prompt end: read from a poisoned page if not copied
            assert reply == hf_greedy(hf, follow_up, 5)[0]
        else:
            assert calls == [(7, 59)]
    assert replies[True] == replies[False]
    for request_id, ids in prompts.items():
        assert replies[True][request_id] == hf_greedy(hf, ids, 5)[0], request_id


def test_a_group_past_the_score_budget_runs_the_whole_step_eagerly(
    tmp_path: Path, get_tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two prompts in one step, one call each: the first group's scores fit MAX_SCORES,
    the second's do not; no group runs (the graph is never called), the step runs eagerly,
    and both replies are transformers'."""
    if not ahead_of_time.available() or not compile_enabled():
        pytest.skip("packages are off here")
    hf, _ = get_tiny("qwen3_5_text")
    path = save_checkpoint(hf, tmp_path / "ckpt")
    engine, graph = poisoned_engine(path, caching=True)
    short, long = prompt(95, 20), prompt(96, 60)  # 4 heads x 20 x 32 keys; x 60 x 64
    monkeypatch.setattr(
        runner_module, "prefill_graph_calls", lambda sizes, heads: [range(0, 1), range(1, 2)]
    )
    monkeypatch.setattr(prefill_graph, "MAX_SCORES", 4 * 60 * 64 - 1)
    calls = graph.step.num_calls
    for request_id, ids in (("short", short), ("long", long)):
        engine.add_request(request_id, ids, SamplingParams(max_tokens=4, temperature=0))
    engine.step()  # both prefills
    assert graph.step.num_calls == calls
    replies = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                replies[out.request_id] = list(out.outputs[0].token_ids)
    assert replies == {"short": hf_greedy(hf, short, 4)[0], "long": hf_greedy(hf, long, 4)[0]}

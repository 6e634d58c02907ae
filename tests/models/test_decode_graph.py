"""The whole-model decode graph (hybridkv.models.decode_graph) against the eager forward.

Each test drives the tiny Qwen3.5 over a poisoned, scrambled arena (tests/models/
paged_runner.py): requests are prefilled eagerly, then one decode step runs both ways from
the same bytes. The graph's package is built once per machine and shape (~50 s) into the
user's package cache, as the engine's own warm-up would.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hybrid_checks import assert_close, prompt
from paged_runner import PagedRunner
from tiny import hf_greedy, make_hf_model, save_checkpoint

from hybridkv.engine import EngineConfig, LLMEngine
from hybridkv.engine.runner import ModelRunner
from hybridkv.layers.moe import SparseMoE
from hybridkv.layers.packed_linear import can_pack, pack_linears
from hybridkv.models import decode_graph
from hybridkv.models.decode_graph import DecodeGraph, decode_graph_plan, load_decode_graph
from hybridkv.models.loader import LoadedModel, load_model
from hybridkv.ops import ahead_of_time
from hybridkv.ops.compiled import compile_enabled
from hybridkv.sched.sampling_params import SamplingParams

PROMPTS = {"a": prompt(21, 19), "b": prompt(22, 40), "c": prompt(23, 3)}


def prefilled(
    get_tiny: Any,
    load: Callable[..., Any],
    prompts: dict[str, list[int]],
    seed: int,
    lm: LoadedModel | None = None,
) -> tuple[PagedRunner, Any]:
    """A runner over ``lm`` (default: the tiny Qwen3.5; a poisoned arena scrambled by
    ``seed``) with ``prompts`` prefilled eagerly, and the graph ``load`` gives over its
    arena; skipped where packages are off (the eager forward serves every step there)."""
    if not ahead_of_time.available() or not compile_enabled():
        pytest.skip("packages are off here (the eager forward serves every step)")
    if lm is None:
        _, lm = get_tiny("qwen3_5_text")
    runner = PagedRunner(lm.model, lm.spec, seed=seed)
    graph = load(lm.model, runner.views)
    assert graph is not None
    with torch.inference_mode():
        for req_id, ids in prompts.items():
            runner.step([(req_id, ids)])
    return runner, graph


@pytest.fixture
def loaded(get_tiny: Any) -> tuple[PagedRunner, DecodeGraph]:
    """A runner with three prefilled requests, and the decode graph over its arena."""
    return prefilled(get_tiny, load_decode_graph, PROMPTS, seed=5)


def _decode(runner: PagedRunner, graph: DecodeGraph | None, work: list[str]) -> torch.Tensor:
    """One decode step of requests ``work`` (token 7 each): eager, or through ``graph``."""
    with torch.inference_mode():
        batch = runner.build_batch([(req_id, [7]) for req_id in work], all_logits=False)
        logits = runner.model(batch, runner.views) if graph is None else graph(batch)
    for req_id in work:
        runner.reqs[req_id].num_computed += 1
    return logits


def _rewinder(runner: PagedRunner) -> Callable[[], None]:
    """A function that puts the arena's bytes and every request's computed tokens back as
    they are now (a request it did not know had computed none)."""
    arena = runner.views.arena.clone()
    computed = {req_id: req.num_computed for req_id, req in runner.reqs.items()}

    def rewind() -> None:
        runner.views.arena.copy_(arena)
        for req_id, req in runner.reqs.items():
            req.num_computed = computed.get(req_id, 0)

    return rewind


def _views(runner: PagedRunner) -> list[torch.Tensor]:
    """Every layer's pages as floats (a copy)."""
    out: list[torch.Tensor] = []
    for key in sorted(runner.views._views):
        view = runner.views[key]
        tensors = [view.key, view.value] if key[1] == "attn" else list(view.tensors.values())
        out += [t.float().clone() for t in tensors]
    return out


def test_the_graph_decodes_as_the_eager_forward(loaded: tuple[PagedRunner, DecodeGraph]) -> None:
    """Same logits and the same pages written (to rounding), and nothing else written: the
    arena's NaN poison stays exactly where the eager step leaves it."""
    runner, graph = loaded
    rewind = _rewinder(runner)
    eager = _decode(runner, None, ["a", "b", "c"])
    eager_pages = _views(runner)
    rewind()
    got = _decode(runner, graph, ["a", "b", "c"])
    assert torch.isfinite(got).all()
    assert_close(got, eager)
    for mine, theirs in zip(_views(runner), eager_pages, strict=True):
        assert torch.equal(mine.isnan(), theirs.isnan())
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4, equal_nan=True)


def bf16_tiny(get_tiny: Any, model_type: str, tmp_path: Path) -> LoadedModel:
    """The tiny ``model_type`` in bf16 with bf16 matmuls on any CPU (the graphs run sparse
    MoE layers in bf16 only: torch's grouped matmul takes no other dtype when traced)."""
    hf, _ = get_tiny(model_type)
    return load_model(save_checkpoint(hf, tmp_path / model_type), "bfloat16", matmul_dtype="model")


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_moe_text"])
def test_the_graph_decodes_sparse_moe_layers_as_the_eager_forward(
    get_tiny: Any, model_type: str, tmp_path: Path
) -> None:
    """Qwen3-Next's tiny model (sparse MoE layers between dense ones) and Qwen3.5-MoE's
    (all sparse, a shared expert each), bf16: the graph's sorted expert layout gives the
    eager forward's logits and pages; three rows route to several experts at once."""
    lm = bf16_tiny(get_tiny, model_type, tmp_path)
    runner, graph = prefilled(get_tiny, load_decode_graph, PROMPTS, seed=6, lm=lm)
    assert_bf16_decodes_agree(runner, None, graph)


def assert_bf16_decodes_agree(
    runner: PagedRunner, want: DecodeGraph | None, got: DecodeGraph | None
) -> None:
    """One decode step of requests a, b, c through ``want`` and, from the same bytes,
    through ``got`` (None: the eager forward): :func:`assert_bf16_close`."""
    rewind = _rewinder(runner)
    expected = _decode(runner, want, ["a", "b", "c"])
    expected_pages = _views(runner)
    rewind()
    assert_bf16_close(
        _decode(runner, got, ["a", "b", "c"]), expected, _views(runner), expected_pages
    )


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_moe_text"])
def test_the_graph_calls_packed_weights_by_handle(
    get_tiny: Any, model_type: str, tmp_path: Path
) -> None:
    """Every linear and expert weight packed for oneDNN (the engine packs small bf16
    models by default): the graph names each weight by its handle and gives the plain
    weights' graph its logits and pages to bf16 rounding (not bit for bit: inductor
    compiles the two graphs' roundings around the products differently; a weight mixed
    up would change every logit), rows routed to several experts at once."""
    if not can_pack(torch.bfloat16):
        pytest.skip("oneDNN cannot pack bf16 on this CPU (AVX2 alone)")
    lm = bf16_tiny(get_tiny, model_type, tmp_path)
    runner, graph = prefilled(get_tiny, load_decode_graph, PROMPTS, seed=6, lm=lm)
    model = copy.deepcopy(lm.model)
    assert pack_linears(model, min_elements=0) > 0
    packed_graph = load_decode_graph(model, runner.views)
    assert packed_graph is not None
    assert_bf16_decodes_agree(runner, graph, packed_graph)


def test_packed_models_of_other_widths_get_other_packages(tmp_path: Path) -> None:
    """A packed weight is no input of the package (a handle is), so its widths must be in
    the package's key: two packed tiny models whose MLPs differ in width alone (the
    same inputs otherwise) are described apart, and so are the MoE experts' splits."""
    if not can_pack(torch.bfloat16):
        pytest.skip("oneDNN cannot pack bf16 on this CPU (AVX2 alone)")
    described = []
    for model_type, width in [
        ("qwen3_5_text", {"intermediate_size": 96}),
        ("qwen3_5_text", {"intermediate_size": 128}),
        ("qwen3_5_moe_text", {"moe_intermediate_size": 32}),
        ("qwen3_5_moe_text", {"moe_intermediate_size": 48}),
    ]:
        hf = make_hf_model(model_type, **width)
        path = save_checkpoint(hf, tmp_path / f"{model_type}-{sorted(width.values())}")
        lm = load_model(path, "bfloat16", matmul_dtype="model")
        assert pack_linears(lm.model, min_elements=0) > 0
        plan = decode_graph_plan(lm.model, PagedRunner(lm.model, lm.spec).views)
        assert plan is not None
        described.append(decode_graph._describe_model(lm.model, plan))
    assert described[0] != described[1] and described[2] != described[3]


def assert_bf16_close(
    got: torch.Tensor,
    eager: torch.Tensor,
    pages: list[torch.Tensor],
    eager_pages: list[torch.Tensor],
) -> None:
    """A bf16 model's graph against its eager forward, which round otherwise at every layer
    (the graphs keep attention scores and the recurrence in fp32, the eager forward rounds
    them to bf16 on a CPU with bf16 matmuls), the random tiny models amplifying it through
    four layers: logits off by up to ~10% of the largest on the Qwen3-Next one
    (2026-11-27; its MoE layers give the eager ones' bits on the same inputs:
    test_the_graphs_sparse_moe_is_the_eager_layers), and a state element in a million by
    up to ~1.2 after a prefill. So: logits within 15% of the largest, the NaN poison
    exactly where it was, and at most one page element in a thousand off by over 0.1."""
    assert torch.isfinite(got).all()
    assert (got - eager).abs().max() <= 0.15 * eager.abs().max()
    for mine, theirs in zip(pages, eager_pages, strict=True):
        assert torch.equal(mine.isnan(), theirs.isnan())
        off = ((mine - theirs).abs() > 0.1) & ~theirs.isnan()
        assert off.sum() <= off.numel() // 1000


def test_the_graphs_sparse_moe_is_the_eager_layers(get_tiny: Any, tmp_path: Path) -> None:
    """The graphs' MoE (``decode_graph.feed_forward``: the sorted expert layout, plain
    gathers) compiled ahead of time with its weights as inputs gives the eager layer's
    bits in bf16 (its padded layout at decode sizes), at 1, 3 and 9 rows of one package."""
    if not ahead_of_time.available() or not compile_enabled():
        pytest.skip("packages are off here")
    lm = bf16_tiny(get_tiny, "qwen3_5_moe_text", tmp_path)
    moe = lm.model.model.layers[0].mlp
    assert isinstance(moe, SparseMoE)

    class FeedForward(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.moe = moe

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return decode_graph.feed_forward(self.moe, x)

    layer = FeedForward()
    names = [n for n, _ in layer.named_parameters()]
    weights = [t.detach() for _, t in layer.named_parameters()]
    example = torch.randn(2, 64).bfloat16()
    flat = [*weights, example]
    key = ahead_of_time.package_key(
        "test-graph-moe", decode_graph._SOURCES, flat, [False] * len(weights) + [True]
    )

    def export() -> torch.export.ExportedProgram:
        with torch.no_grad():
            return torch.export.export(
                decode_graph._Exported(layer, names),
                (tuple(weights), (example,)),
                dynamic_shapes=(tuple(None for _ in weights), ({0: torch.export.Dim("rows")},)),
            )

    step = ahead_of_time.load_or_build(key, export, {"emulate_precision_casts": True})
    assert step is not None
    torch.manual_seed(0)
    with torch.inference_mode():
        for num_rows in (1, 3, 9):
            x = torch.randn(num_rows, 64).bfloat16()
            assert torch.equal(step(*weights, x)[0], moe(x))


def test_a_row_alone_and_in_a_batch_agree(loaded: tuple[PagedRunner, DecodeGraph]) -> None:
    """Request a alone and beside longer and shorter requests (wider key tables, masked
    columns): the same logits and pages to rounding, the same greedy token."""
    runner, graph = loaded
    rewind = _rewinder(runner)
    alone = _decode(runner, graph, ["a"])
    alone_arena = runner.views.arena.clone()
    rewind()
    together = _decode(runner, graph, ["b", "a", "c"])
    assert_close(together[1:2], alone)
    assert int(together[1].argmax()) == int(alone[0].argmax())
    a = runner.reqs["a"]
    for key in sorted(runner.views._views):  # a's own pages, in both arenas
        view = runner.views[key]
        if key[1] == "attn":
            pages = torch.tensor(a.blocks[view.group_id])
            tensors = [view.key, view.value]
        else:
            pages = torch.tensor([a.state_page[view.group_id]])
            tensors = list(view.tensors.values())
        for tensor in tensors:
            mine, theirs = tensor[pages], _same_view(tensor, alone_arena)[pages]
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4, equal_nan=True)


def _same_view(view: torch.Tensor, arena: torch.Tensor) -> torch.Tensor:
    """``view``'s strides and offset over another arena of the same layout."""
    flat = arena.view(view.dtype)
    return flat.as_strided(view.shape, view.stride(), view.storage_offset())


def test_a_lone_decode_and_a_fresh_one_run_the_graph(
    loaded: tuple[PagedRunner, DecodeGraph],
) -> None:
    """A batch of one row, and a request whose first token is a decode (a fresh state page
    full of NaN: started from zeros, never multiplied), equal the eager forward."""
    runner, graph = loaded
    rewind = _rewinder(runner)
    eager = _decode(runner, None, ["fresh"])
    rewind()
    got = _decode(runner, graph, ["fresh"])
    assert torch.isfinite(got).all()
    assert_close(got, eager)


def test_models_the_graph_does_not_know_keep_the_eager_forward(
    get_tiny: Any, tmp_path: Path
) -> None:
    """The dense Qwen3.5's and the bf16 sparse MoE models' layers are planned in order,
    their experts' weights stacked or packed for oneDNN; MoE experts the graph does not
    compute as the eager forward (fp32, with biases, another activation) leave a model to
    the eager forward."""
    models = [get_tiny("qwen3_5_text")[1]]
    models += [bf16_tiny(get_tiny, t, tmp_path) for t in ("qwen3_next", "qwen3_5_moe_text")]
    for lm in models:
        plan = decode_graph_plan(lm.model, PagedRunner(lm.model, lm.spec).views)
        assert plan is not None
        assert [p.kind for p in plan.layers] == ["gdn", "attention", "gdn", "attention"]
    _, fp32 = get_tiny("qwen3_5_moe_text")
    assert decode_graph_plan(fp32.model, PagedRunner(fp32.model, fp32.spec).views) is None
    lm = models[-1]
    views = PagedRunner(lm.model, lm.spec).views
    if can_pack(torch.bfloat16):  # (not on a CPU with AVX2 alone)
        packed = copy.deepcopy(lm.model)
        assert pack_linears(packed, min_elements=0) > 0
        assert decode_graph_plan(packed, views) is not None
    changes: list[Callable[[Any], None]] = [
        lambda experts: setattr(experts, "down_bias", torch.nn.Parameter(torch.zeros(4, 64))),
        lambda experts: setattr(experts, "act", torch.nn.functional.gelu),
    ]
    for change in changes:
        model = copy.deepcopy(lm.model)
        change(model.model.layers[1].mlp.experts)
        assert decode_graph_plan(model, views) is None


def test_subclasses_that_may_compute_otherwise_keep_the_eager_forward(get_tiny: Any) -> None:
    """The plan checks exact classes: a subclass of an attention layer, of a norm or of the
    RoPE tables may round or rotate otherwise than the graph does."""
    _, lm = get_tiny("qwen3_5_text")
    views = PagedRunner(lm.model, lm.spec).views
    attention = lm.model.model.layers[1].self_attn
    for module in (attention, attention.q_norm, attention.rotary, lm.model.model.norm):
        model = copy.deepcopy(lm.model)
        twin = model.get_submodule(_name_in(lm.model, module))
        twin.__class__ = type("Subclass", (type(module),), {})
        assert decode_graph_plan(model, views) is None


def _name_in(model: torch.nn.Module, module: torch.nn.Module) -> str:
    return next(name for name, sub in model.named_modules() if sub is module)


def engines_on_and_off(
    tmp_path: Path, get_tiny: Any, max_model_len: int
) -> tuple[Any, LLMEngine, LLMEngine]:
    """(transformers' tiny Qwen3.5, an engine of its checkpoint with caching on, one with
    caching off), small caches; skipped where packages are off (no graph to test)."""
    if not ahead_of_time.available() or not compile_enabled():
        pytest.skip("packages are off here")
    hf, _ = get_tiny("qwen3_5_text")
    path = save_checkpoint(hf, tmp_path / "ckpt")
    options = {"model": str(path), "cache_memory_gib": 0.02, "max_model_len": max_model_len}
    on = LLMEngine(EngineConfig(**options))
    off = LLMEngine(EngineConfig(enable_prefix_caching=False, **options))
    return hf, on, off


def test_an_engine_decodes_through_the_graph_and_snapshots_after_it(
    tmp_path: Path, get_tiny: Any
) -> None:
    """Caching on, a follow-up turn hits the state its previous turn left after its last
    decode (a snapshot the runner copies after the graph), and every reply equals caching
    off's and transformers' greedy tokens."""
    hf, on, off = engines_on_and_off(tmp_path, get_tiny, max_model_len=256)
    assert on.runner.decode_graph is not None
    first = prompt(31, 40)
    replies, cached = [], []
    for engine in (on, off):
        reply, _ = generate(engine, "t1", first)
        follow_up = first + reply + prompt(32, 9)
        reply2, hit2 = generate(engine, "t2", follow_up)
        replies.append((reply, reply2))
        cached.append(hit2)
    assert replies[0] == replies[1]
    assert replies[0][0] == hf_greedy(hf, first, 16)[0]
    assert replies[0][1] == hf_greedy(hf, first + replies[0][0] + prompt(32, 9), 16)[0]
    assert cached[0] > len(first) and cached[1] == 0
    assert on.runner.decode_graph.step.num_calls > 0


def generate(
    engine: LLMEngine, request_id: str, ids: list[int], num_tokens: int = 16
) -> tuple[list[int], int]:
    """(``num_tokens`` greedy tokens, prompt tokens served from the cache)."""
    engine.add_request(request_id, ids, SamplingParams(max_tokens=num_tokens, temperature=0))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return list(out.outputs[0].token_ids), out.num_cached_tokens
    raise AssertionError("no output")


def test_the_engine_runs_decodes_through_the_graph_and_eagerly_when_asked(
    get_tiny: Any,
) -> None:
    """A runner loads the graph at warm-up where packages are on, and none while compiling
    is off (``enforce_eager``)."""
    if not ahead_of_time.available():
        pytest.skip("packages are off here")
    from hybridkv.ops.compiled import running_eagerly

    _, lm = get_tiny("qwen3_5_text")
    layout = PagedRunner(lm.model, lm.spec).layout
    runner = ModelRunner(lm.model, lm.spec, layout, torch.device("cpu"))
    with running_eagerly():
        runner.warm_up_compiled()
    assert runner.decode_graph is None
    runner.warm_up_compiled()
    assert runner.decode_graph is not None

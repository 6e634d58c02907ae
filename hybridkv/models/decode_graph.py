"""A decode's whole model step, embeddings to logits, as one package compiled ahead of time.

At decode sizes a step's model forward is bound by dispatch, not arithmetic: the tests'
tiny Qwen3.5 runs ~240 ATen ops a decode step, each 5-10 us of dispatch and Python on this
project's CPU, so 8 decodes took ~6 ms for a few microseconds of arithmetic. vLLM and SGLang
replay a captured CUDA graph there; a CPU has none, but AOTInductor compiles the whole step
to one C++ function (:mod:`hybridkv.ops.ahead_of_time`: built once per machine and model
shape, loaded in milliseconds). Measured on the tiny Qwen3.5 (benchmarks/README.md), the
forward of 8 decodes 5.2 -> 1.0 ms, of 64 decodes 8.6 -> 4.4 ms; a whole engine step of 8
decodes 0.26x of its eager time, of 64 decodes 0.63x.

The graph is a second form of the same forward, written from the layers' own pieces (their
projections, weights and the GDN decode step of
:mod:`hybridkv.ops.gated_delta_rule.mixer_decode`) for rows that decode one token: it writes
each row's K/V and recurrent states into the same pages and returns the same logits to
rounding (tested on a poisoned arena: it writes nothing else and reads no garbage, a
masked key's value zeroed before its weight of 0 multiplies it). Its attention keeps the
scores and probabilities in fp32, where the eager bf16 path on a CPU with native bf16
matmuls rounds both to bf16 as transformers does (tested since 2026-11-27 on such a CPU:
tests/models/test_decode_graph.py, the bf16 MoE models). The model runner runs it for the
one-token chunks (decodes, or one-token prompts) of steps whose other chunks are short
prefills, which the prefill graph runs (:mod:`hybridkv.models.prefill_graph`, built
from this module's pieces: :func:`attention_inputs`, :func:`through_layers`,
:func:`load_graph_package`); a step that holds a longer prefill runs the eager forward
over all its rows. A decode's logits
so differ by rounding between the two kinds of step, as they already did with the batch's
size: the linears' MKL kernels round a row differently with the number of rows (checked:
one row alone and among three, the same weights, other bits).

Only models made of pieces the graph knows run it (:func:`decode_graph_plan`): pre-norm
decoder layers of paged full attention (RoPE, q/k norms, an output gate) or Gated DeltaNet,
a gated MLP or Qwen3-Next's sparse MoE in bf16 (:func:`feed_forward`: the sorted expert
layout, one grouped matmul per weight; 2026-11-27), RMSNorms, plain or fp32 linears and
embeddings, the base LM head, and any of these linears packed for oneDNN (called by their
handles: :mod:`hybridkv.layers.packed_linear`). Others (fp32 MoE: traced, torch's grouped
matmul takes bf16 only; Mamba, sliding windows, scaled embeddings) keep the eager forward,
as do engines that run eagerly or where no package can be built. The weights are the
package's inputs, not its constants: one package serves every checkpoint of a shape.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridkv.forward.batch import ForwardBatch
from hybridkv.forward.views import CacheViews
from hybridkv.layers import fp32_matmul, gated_deltanet, mlp, moe, packed_linear
from hybridkv.layers.attention import PagedAttention
from hybridkv.layers.fp32_matmul import Fp32Embedding, Fp32Linear
from hybridkv.layers.gated_deltanet import (
    GatedDeltaNet,
    Qwen3NextGatedDeltaNet,
    Qwen35GatedDeltaNet,
)
from hybridkv.layers.mlp import GatedMLP
from hybridkv.layers.moe import GroupedExperts, SparseMoE
from hybridkv.layers.norm import RMSNorm, ZeroCenteredRMSNorm
from hybridkv.layers.packed_linear import PackedLinear
from hybridkv.layers.rope import RotaryEmbedding
from hybridkv.models.base import CausalLM, DecoderStack
from hybridkv.models.common import PreNormDecoderLayer
from hybridkv.ops import ahead_of_time, row_copy
from hybridkv.ops.ahead_of_time import AheadOfTimeStep
from hybridkv.ops.gated_delta_rule import mixer_decode
from hybridkv.ops.gated_delta_rule.mixer_decode import StepParams, StepViews

# the exact classes the graph computes (a subclass may compute otherwise)
_NORMS = (ZeroCenteredRMSNorm, RMSNorm)
_LINEARS = (nn.Linear, Fp32Linear, PackedLinear)
_EMBEDDINGS = (nn.Embedding, Fp32Embedding)
_GDN_MIXERS = (Qwen35GatedDeltaNet, Qwen3NextGatedDeltaNet)
# the model's methods the graph stands for: an architecture that overrides one is not it
_BASE_METHODS = ("forward", "embed", "compute_logits")
# rows and key pages of the example batch the graph is exported on (torch specialises a
# size of one; the package runs any size, one included)
_EXAMPLE_ROWS = 2
_EXAMPLE_PAGES = 2


@dataclass(frozen=True)
class LayerPlan:
    """How the graph runs one decoder layer: its mixer kind and cache group."""

    kind: str  # "attention" | "gdn"
    group_id: int

    @property
    def num_caches(self) -> int:
        """Its cache inputs (:func:`cache_inputs`): attention K and V; GDN conv, SSM
        written and SSM read."""
        return 2 if self.kind == "attention" else 3


@dataclass(frozen=True)
class GraphPlan:
    """The layers of a model the graph can run, and its cache groups in input order."""

    layers: tuple[LayerPlan, ...]
    attention_groups: tuple[int, ...]
    recurrent_groups: tuple[int, ...]

    def tables_and_pages(self, batch: ForwardBatch) -> tuple[list[Tensor], list[Tensor]]:
        """(each attention group's block table, each recurrent group's live pages) of
        ``batch``, in the plan's group order (both graphs' inputs)."""
        return (
            [batch.block_tables[g] for g in self.attention_groups],
            [batch.state_pages[g] for g in self.recurrent_groups],
        )


def _plain_attention(mixer: PagedAttention) -> bool:
    """Whether ``mixer``'s pieces are the ones the graph computes: its q/k norms of a known
    class and plain RoPE (a subclass may round or rotate otherwise)."""
    norms = (mixer.q_norm, mixer.k_norm) if mixer.cfg.qk_norm is not None else ()
    rotary_ok = mixer.rotary is None or type(mixer.rotary) is RotaryEmbedding
    return rotary_ok and all(type(n) in _NORMS for n in norms)


def _silu_mlp(module: nn.Module | None) -> bool:
    return type(module) is GatedMLP and module.act is F.silu


def _known_feed_forward(module: nn.Module) -> bool:
    """A SiLU gated MLP, or Qwen3-Next's sparse MoE (softmax top-k router, SiLU gated
    experts without biases, an optional shared SiLU MLP behind a sigmoid gate): what
    :func:`feed_forward` computes."""
    if _silu_mlp(module):
        return True
    if type(module) is not SparseMoE or not _known_experts(module.experts):
        return False
    return (
        (module.shared_expert is None or _silu_mlp(module.shared_expert))
        and (module.shared_expert_gate is None or type(module.shared_expert_gate) in _LINEARS)
        and type(module.gate) in _LINEARS
    )


def _known_experts(experts: nn.Module) -> bool:
    """SiLU gated experts in bf16 without biases: stacked weights the grouped matmul takes
    as they are, or weights packed for oneDNN (one call by handle per weight). bf16 only:
    traced, torch's grouped matmul refuses other dtypes (its eager CPU kernel takes fp32
    too), so an fp32 MoE model, or a bf16 one whose experts multiply in fp32 on a CPU
    without bf16 instructions, keeps the eager forward; packed, the graphs run the dtype
    their tests cover."""
    if type(experts) is not GroupedExperts or experts.matmul_dtype is not None:
        return False
    if not experts.gated or experts.act is not F.silu:
        return False
    if experts.packed is not None:
        return all(
            type(linear) is PackedLinear
            and linear.bias is None
            and linear.packed_weight.dtype == torch.bfloat16
            for pair in experts.packed
            for linear in pair
        )
    weights = (experts.gate_up_proj, experts.down_proj)
    return (
        experts.gate_up_bias is None
        and experts.down_bias is None
        and all(
            w is not None and w.dtype == torch.bfloat16 and moe.grouped_mm_aligned(w)
            for w in weights
        )
    )


def feed_forward(module: nn.Module, x: Tensor) -> Tensor:
    """A layer's MLP or sparse MoE over the rows ``x``, as the graphs compute it: a MoE
    always in the sorted layout (its sizes depend on no value; the same bits as the
    padded one in bf16 and fp16, and as the eager forward's for the batch's size in fp32)."""
    if isinstance(module, SparseMoE):
        return module(x, padded=False)
    return module(x)


def decode_graph_plan(model: CausalLM, views: CacheViews) -> GraphPlan | None:
    """The graph's plan for ``model`` over ``views``, or None where a piece of the model is
    one the graph does not know (module doc): the eager forward serves it."""
    cls = type(model)
    if any(getattr(cls, name) is not getattr(CausalLM, name) for name in _BASE_METHODS):
        return None
    stack = model.model
    if type(stack) is not DecoderStack or type(stack.norm) not in _NORMS:
        return None
    if type(stack.embed_tokens) not in _EMBEDDINGS or type(model.lm_head) not in _LINEARS:
        return None
    layers: list[LayerPlan] = []
    for index, layer in enumerate(stack.layers):
        if type(layer).forward is not PreNormDecoderLayer.forward:
            return None
        norms = [getattr(layer, name) for name in layer.norm_names]
        feed_forward = getattr(layer, layer.feed_forward_name)
        if any(type(n) not in _NORMS for n in norms) or not _known_feed_forward(feed_forward):
            return None
        mixer = getattr(layer, layer.mixer_name)
        if type(mixer) is PagedAttention:
            view = views.attn(index)
            if view.window_tokens is not None or not _plain_attention(mixer):
                return None
            layers.append(LayerPlan("attention", view.group_id))
        elif type(mixer) in _GDN_MIXERS:
            layers.append(LayerPlan("gdn", views.state(index).group_id))
        else:
            return None
    attention = tuple(dict.fromkeys(p.group_id for p in layers if p.kind == "attention"))
    recurrent = tuple(dict.fromkeys(p.group_id for p in layers if p.kind == "gdn"))
    return GraphPlan(tuple(layers), attention, recurrent)


def norm(module: nn.Module, x: Tensor) -> Tensor:
    """``module``'s RMSNorm of ``x`` over its last dim, rounded where the module rounds."""
    width = (x.shape[-1],)
    if isinstance(module, ZeroCenteredRMSNorm):
        scale = 1.0 + module.weight.float()
        return F.rms_norm(x.float(), width, scale, module.eps).to(x.dtype)
    assert isinstance(module, RMSNorm)
    return module.weight * F.rms_norm(x.float(), width, None, module.eps).to(x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on the first ``cos.shape[-1]`` dims of every head of ``x`` [B, H, D]."""
    rot = cos.shape[-1]
    half = rot // 2
    x_rot = x[..., :rot]
    partner = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    rotated = x_rot * cos[:, None, :] + partner * sin[:, None, :]
    return torch.cat([rotated, x[..., rot:]], dim=-1)


def attention_inputs(
    mixer: PagedAttention, h: Tensor, positions: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(q [T, Hq, D], k, v [T, Hkv, D], the output gate [T, Hq * D] or None) of rows ``h``
    [T, H] at ``positions`` [T]: the layer's projections, q/k norms and RoPE."""
    cfg = mixer.cfg
    q = mixer.q_proj(h).unflatten(1, (cfg.num_heads, -1))  # [T, Hq, D or 2D]
    gate = None
    if cfg.output_gate:
        q, gate = q.split(cfg.head_dim, dim=-1)
        gate = gate.flatten(1)
    k = mixer.k_proj(h).unflatten(1, (cfg.num_kv_heads, cfg.head_dim))
    v = mixer.v_proj(h).unflatten(1, (cfg.num_kv_heads, cfg.head_dim))
    if cfg.qk_norm is not None:
        q, k = norm(mixer.q_norm, q), norm(mixer.k_norm, k)
    if mixer.rotary is not None:
        freqs = positions[:, None].float() * mixer.rotary.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    return q, k, v, gate


def _attention(
    mixer: PagedAttention,
    h: Tensor,
    positions: Tensor,
    table: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
) -> Tensor:
    """One attention layer's output for decodes ``h`` [B, H]: this token's K/V written into
    its page slot, then softmax attention over the request's keys in fp32."""
    cfg, num = mixer.cfg, h.shape[0]
    q, k, v, gate = attention_inputs(mixer, h, positions)
    block = key_cache.shape[1]
    page = table.gather(1, (positions // block)[:, None])[:, 0]
    slot = positions % block
    key_cache[page, slot] = k.to(key_cache.dtype)
    value_cache[page, slot] = v.to(value_cache.dtype)
    pages = table.clamp(min=0)  # -1 past a request's pages: masked below
    # keys head-major and page-blocked [B, Hkv, W, block, D], the scores as products summed
    # over D: inductor fuses them with the gather, and a reduction over a page's slots
    # looks its page up once (an einsum became batched matmuls of 2 x 24 blocks, 487 ->
    # 308 us a layer for 64 decodes over 64 keys, the tiny model's heads; page-blocked,
    # with the softmax's division after the sum, 369 -> 311 us at 80 keys)
    keys = key_cache[pages].float().permute(0, 3, 1, 2, 4)
    values = value_cache[pages].float().permute(0, 3, 1, 2, 4)
    grouped = q.float().unflatten(1, (cfg.num_kv_heads, -1))  # [B, Hkv, rep, D]: h = g * rep + i
    scores = (grouped[:, :, :, None, None, :] * keys[:, :, None]).sum(-1) * mixer.scale
    slot = torch.arange(keys.shape[2] * block, device=h.device).view(-1, block)
    valid = slot[None] <= positions[:, None, None]  # [B, W, block]
    scores = scores.masked_fill(~valid[:, None, None], float("-inf"))  # [B, Hkv, rep, W, block]
    top = scores.amax((-1, -2), keepdim=True)
    weights = (scores - top).exp()
    # a weight of 0 times garbage (NaN in a slot never written) is NaN: zero those values
    values = values.masked_fill(~valid[:, None, :, :, None], 0.0)
    summed = (weights[..., None] * values[:, :, None]).sum(-2).sum(-2)  # [B, Hkv, rep, D]
    out = summed / weights.sum((-1, -2))[..., None]
    out = out.to(h.dtype).reshape(num, -1)
    if gate is not None:
        out = out * torch.sigmoid(gate)
    return mixer.o_proj(out)


def _gdn(
    mixer: GatedDeltaNet,
    h: Tensor,
    pages: Tensor,
    fresh: Tensor,
    taps: Tensor,
    caches: tuple[Tensor, ...],
) -> Tensor:
    """One GDN layer's output for decodes ``h`` [B, H], through the mixer's decode step
    (``taps``: its conv's, :meth:`GraphStep.conv_taps`)."""
    qkv, z, b, a = mixer.project(h)
    weights = mixer.mixer_weights()
    eps = torch.full((), weights.norm_eps, dtype=torch.float32, device=h.device)
    params = StepParams(weights.conv, weights.a_log, weights.dt_bias, weights.norm, eps, taps)
    conv, ssm, ssm_source = caches
    gated, *_ = mixer_decode._mixer_decode_fused(
        qkv, z, b, a, pages, fresh, StepViews(conv, ssm, ssm_source), params
    )
    return mixer.out_proj(gated)


# one layer's mixer in a graph: (layer index, its plan, the mixer, its normed input, its
# caches: attention K and V, or GDN conv, SSM written, SSM read) -> the mixer's output
Mix = Callable[[int, LayerPlan, nn.Module, Tensor, tuple[Tensor, ...]], Tensor]


def through_layers(
    model: CausalLM, plan: GraphPlan, x: Tensor, caches: Sequence[Tensor], mix: Mix
) -> Tensor:
    """The decoder stack over embedded rows ``x`` as the graphs run it: each pre-norm
    layer's mixer by ``mix``, then its MLP, and the final norm (not the LM head)."""
    stack = model.model
    at = 0
    for index, (layer, layer_plan) in enumerate(zip(stack.layers, plan.layers, strict=True)):
        mixer_norm, ff_norm = (getattr(layer, name) for name in layer.norm_names)
        own = tuple(caches[at : at + layer_plan.num_caches])
        at += layer_plan.num_caches
        mixer = getattr(layer, layer.mixer_name)
        x = x + mix(index, layer_plan, mixer, norm(mixer_norm, x), own)
        x = x + feed_forward(getattr(layer, layer.feed_forward_name), norm(ff_norm, x))
    return norm(stack.norm, x)


class GraphStep(nn.Module):
    """A forward a graph is traced from: the model a submodule (whose weights
    :class:`_Exported` swaps for the package's inputs) and the graph's plan."""

    def __init__(self, model: CausalLM, plan: GraphPlan) -> None:
        super().__init__()
        self.model = model
        self.plan = plan
        # each GDN layer's conv taps as a weight of the graph's own (mixer_decode.conv_taps:
        # read from the conv weight inside the graph, the conv is not vectorised; 64 x 48
        # prefill rows of the tiny model 2.4 -> 0.7 ms, isolated under torch.compile)
        for index, layer in enumerate(model.model.layers):
            mixer = getattr(layer, layer.mixer_name)
            if isinstance(mixer, GatedDeltaNet):
                taps = mixer_decode.conv_taps(mixer.mixer_weights().conv)
                self.register_buffer(f"conv_taps_{index}", taps, persistent=False)

    def conv_taps(self, index: int) -> Tensor:
        """Layer ``index``'s conv taps [K, C] fp32 (a GDN layer's)."""
        taps = getattr(self, f"conv_taps_{index}")
        assert isinstance(taps, Tensor)
        return taps

    def by_group(
        self, tables: Sequence[Tensor], pages: Sequence[Tensor]
    ) -> tuple[dict[int, Tensor], dict[int, Tensor]]:
        """(each attention group's block table, each recurrent group's live pages) by
        group id, from the inputs in the plan's group order."""
        plan = self.plan
        return (
            dict(zip(plan.attention_groups, tables, strict=True)),
            dict(zip(plan.recurrent_groups, pages, strict=True)),
        )


class _Step(GraphStep):
    """The decode forward the graph is traced from."""

    def forward(
        self,
        ids: Tensor,
        positions: Tensor,
        tables: tuple[Tensor, ...],
        pages: tuple[Tensor, ...],
        fresh: Tensor,
        caches: tuple[Tensor, ...],
    ) -> Tensor:
        table_of, pages_of = self.by_group(tables, pages)

        def mix(
            index: int,
            layer_plan: LayerPlan,
            mixer: nn.Module,
            h: Tensor,
            own: tuple[Tensor, ...],
        ) -> Tensor:
            group = layer_plan.group_id
            if layer_plan.kind == "attention":
                assert isinstance(mixer, PagedAttention)
                return _attention(mixer, h, positions, table_of[group], *own)
            assert isinstance(mixer, GatedDeltaNet)
            return _gdn(mixer, h, pages_of[group], fresh, self.conv_taps(index), own)

        embedded = self.model.model.embed_tokens(ids)
        x = through_layers(self.model, self.plan, embedded, caches, mix)
        return self.model.lm_head(x).float()


class _Exported(nn.Module):
    """A step module over explicit weights (the package's first inputs), as
    :func:`torch.export.export` takes it; the step is kept out of this module's tree, so
    its weights are inputs, not constants baked into the package. The step's own inputs
    come as one tuple, whatever the step (the decode and the prefill graph share this)."""

    def __init__(self, step: nn.Module, names: list[str]) -> None:
        super().__init__()
        self._step = (step,)
        self.names = names

    def forward(self, weights: tuple[Tensor, ...], inputs: tuple[object, ...]) -> Tensor:
        state = dict(zip(self.names, weights, strict=True))
        return torch.func.functional_call(self._step[0], state, inputs)


def cache_inputs(model: CausalLM, views: CacheViews, plan: GraphPlan) -> list[Tensor]:
    """Each layer's pages as the graph takes them, in layer order: attention K and V, GDN
    conv (read and written), SSM (written) and SSM (read). Each is an alias with its own
    storage object over the arena's memory (mixer_decode._reading_alias): torch merges
    mutated inputs of one storage into a synthetic base it cannot compile here."""
    caches: list[Tensor] = []
    for index, layer_plan in enumerate(plan.layers):
        alias = mixer_decode._reading_alias
        if layer_plan.kind == "attention":
            view = views.attn(index)
            caches += [alias(view.key, f"graph-k{index}"), alias(view.value, f"graph-v{index}")]
        else:
            state = views.state(index)
            caches += [
                alias(state["conv"], "write"),  # the decode step's own conv alias
                alias(state["ssm"], f"graph-ssm{index}"),
                alias(state["ssm"]),  # the decode step's read alias
            ]
    return caches


def _describe_model(model: CausalLM, plan: GraphPlan) -> str:
    """What the graph bakes in beyond its inputs' shapes: the config's constants
    (epsilons, RoPE, scales, switches), the pieces' classes, and the shapes of what is no
    input: packed weights (called by handle, a 0-d input: a package built for other
    widths would read past their rows) and the experts' gate/up split."""
    parts = [type(model).__name__, repr(plan)]
    for module in model.modules():
        if isinstance(module, PackedLinear):
            weight = module.packed_weight
            bias = module.bias is not None
            width = f"{module.in_features}x{module.out_features}"
            parts.append(f"PackedLinear {width} {weight.dtype} bias={bias}")
        elif isinstance(module, GroupedExperts):
            parts.append(f"GroupedExperts {module.num_experts} x {module.intermediate}")
        elif isinstance(module, PagedAttention):
            parts.append(repr(module.cfg) + f" scale={module.scale!r}")
        elif isinstance(module, GatedDeltaNet):
            parts.append(repr(module.cfg))
        elif isinstance(module, _NORMS):
            parts.append(f"{type(module).__name__} eps={module.eps!r}")
        elif isinstance(module, _LINEARS + _EMBEDDINGS):
            parts.append(type(module).__name__)
        elif isinstance(module, SparseMoE):  # (its experts' count is in their weights' shape)
            shared = module.shared_expert is not None
            parts.append(f"SparseMoE top_k={module.top_k} norm={module.norm_topk_prob} {shared}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


class DecodeGraph:
    """A loaded decode graph: call it with a batch of one-token rows for their logits."""

    def __init__(
        self, step: AheadOfTimeStep, plan: GraphPlan, weights: list[Tensor], caches: list[Tensor]
    ) -> None:
        self.step = step
        self.plan = plan
        self.weights = weights
        self.caches = caches

    def __call__(self, batch: ForwardBatch) -> Tensor:
        """[B, vocab] fp32 logits of a batch whose every request decodes one token (the
        runner's decode batch: contiguous int64 ids, positions, tables and pages)."""
        assert batch.has_initial_state is not None
        tables, pages = self.plan.tables_and_pages(batch)
        return self.run(batch.input_ids, batch.positions, tables, pages, ~batch.has_initial_state)

    def run(
        self,
        ids: Tensor,
        positions: Tensor,
        tables: Sequence[Tensor],
        pages: Sequence[Tensor],
        fresh: Tensor,
    ) -> Tensor:
        """[B, vocab] fp32 logits of B one-token rows: their ids and positions [B], each
        attention group's block table [B, W] and each recurrent group's live page [B]
        (the plan's group order), ``fresh`` [B] bool (a state page that holds garbage)."""
        flat = (*self.weights, ids, positions, *tables, *pages, fresh)
        return self.step(*flat, *self.caches)[0]


def _examples(
    plan: GraphPlan, device: torch.device
) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor], Tensor]:
    """The example batch the graph is exported on: ids, positions, tables, pages, fresh."""
    rows = _EXAMPLE_ROWS

    def longs(*shape: int) -> Tensor:
        return torch.zeros(shape, dtype=torch.long, device=device)

    tables = [longs(rows, _EXAMPLE_PAGES) for _ in plan.attention_groups]
    pages = [torch.arange(rows, device=device) for _ in plan.recurrent_groups]
    fresh = torch.zeros(rows, dtype=torch.bool, device=device)
    return longs(rows), longs(rows), tables, pages, fresh


# what the graph's code is made of (a change to one is a new package)
_SOURCES = (
    sys.modules[__name__],
    *mixer_decode._SOURCES,
    gated_deltanet,
    mlp,
    moe,
    row_copy,
    fp32_matmul,
    packed_linear,  # (the schema of the ops the graph calls by name)
)


def load_graph_package(
    name: str,
    step: nn.Module,
    model: CausalLM,
    plan: GraphPlan,
    inputs: tuple[object, ...],
    shapes: tuple[object, ...],
    sources: tuple[ModuleType, ...],
) -> tuple[AheadOfTimeStep, list[Tensor]] | None:
    """(the package of ``step`` loaded, built the first time on this machine, and the
    weights it takes first), or None where no package can be built or loaded.

    ``inputs``: an example of the step's arguments (tensors and tuples of tensors) whose
    last is the caches (:func:`cache_inputs`); ``shapes``: their dynamic dims as
    :func:`torch.export.export` takes them. The key covers ``sources``, the model's
    constants and every input's dtype, sizes and strides (a dynamic first size as any)."""
    # (oneDNN-packed weights stay out: opaque, export cannot read them; the graph calls
    # them by handle, an input like any buffer)
    named = [
        (n, t)
        for n, t in (*step.named_parameters(), *step.named_buffers())
        if t.layout == torch.strided
    ]
    names = [n for n, _ in named]
    weights = [t.detach() for _, t in named]
    flat: list[Tensor] = [*weights]
    dynamic: list[bool] = [False] * len(weights)
    for value, dims in zip(inputs, shapes, strict=True):
        values = value if isinstance(value, tuple) else (value,)
        per = dims if isinstance(dims, tuple) else (dims,)
        for tensor, tensor_dims in zip(values, per, strict=True):
            assert isinstance(tensor, Tensor)
            flat.append(tensor)
            dynamic.append(isinstance(tensor_dims, dict) and 0 in tensor_dims)
    key = ahead_of_time.package_key(
        name, sources, flat, dynamic, extra=_describe_model(model, plan)
    )

    def export() -> torch.export.ExportedProgram:
        all_shapes = (tuple(None for _ in weights), shapes)
        with torch.no_grad():
            return torch.export.export(
                _Exported(step, names), (tuple(weights), inputs), dynamic_shapes=all_shapes
            )

    loaded = ahead_of_time.load_or_build(key, export, {"emulate_precision_casts": True})
    return None if loaded is None else (loaded, weights)


def load_decode_graph(model: CausalLM, views: CacheViews) -> DecodeGraph | None:
    """The decode graph of ``model`` over ``views``, loaded (built the first time on this
    machine, ~40-60 s), or None where the model, device or machine cannot run one."""
    if not ahead_of_time.available() or views.arena.device.type != "cpu":
        return None
    plan = decode_graph_plan(model, views)
    if plan is None:
        return None
    caches = cache_inputs(model, views, plan)
    ids, positions, tables, pages, fresh = _examples(plan, views.arena.device)
    batch = torch.export.Dim("batch", min=1)
    width = torch.export.Dim("width", min=1)
    inputs = (ids, positions, tuple(tables), tuple(pages), fresh, tuple(caches))
    shapes = (
        {0: batch},
        {0: batch},
        tuple({0: batch, 1: width} for _ in tables),
        tuple({0: batch} for _ in pages),
        {0: batch},
        tuple({0: torch.export.Dim(f"pages{i}", min=1)} for i in range(len(caches))),
    )
    loaded = load_graph_package(
        "decode-graph", _Step(model, plan), model, plan, inputs, shapes, _SOURCES
    )
    if loaded is None:
        return None
    return DecodeGraph(loaded[0], plan, loaded[1], caches)

"""Time of one engine step on a GPU, from the FLOPs it does and the bytes it moves.

A step runs a batch of sequences, each computing ``n`` new tokens after ``ctx`` cached
ones (a prefill chunk: n > 1; a decode: n = 1)::

    flops = sum 2 * active_params * n                     matmuls (weights)
          + sum attn_flops * n * (ctx + n / 2)            QK^T and AV over the context
          + sum recurrent_flops * n                       state update and readout
    bytes = weight_bytes                                  weights, read once per step
          + sum kv_bytes_per_token * (ctx + n)            KV read by attention
          + sum kv_bytes_per_token * n                    KV written
          + sum 2 * state_bytes_per_seq                   live state read and written
          + num_copies * 2 * state_bytes_per_seq          snapshot / restore copies
    time  = max(flops / (peak * compute_eff), bytes / (bandwidth * bandwidth_eff)) + overhead

so a long prefill is compute-bound and a decode batch memory-bound, as on real GPUs.
Parameters come from the config's ``total_params`` note when it has one ("35B total / 3B
active"), else from the usual estimate: per layer ``4 h^2`` for the mixer projections plus
``3 h I`` for a gated MLP (``I = 8h/3`` when absent; MoE: ``E`` experts in total, ``k``
active, plus the shared expert), plus ``V h`` for the embedding and again for an untied head.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybridkv.core.model_config import flatten_text_config
from hybridkv.core.spec import AttentionSpec, ModelSpec, RecurrentStateSpec, SlidingWindowSpec
from hybridkv.sim.gpus import Gpu

WEIGHT_BYTES_PER_PARAM = 2  # bf16 weights


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelCost:
    """What one token costs in a model: arithmetic and bytes, estimated from its config."""

    total_params: float
    active_params: float
    params_source: str  # "config note" or "estimate"
    attn_flops_per_pair: float  # per (query token, context token), all attention layers
    recurrent_flops_per_token: float  # all recurrent layers
    kv_bytes_per_token: int
    state_bytes_per_seq: int


@dataclass(frozen=True, kw_only=True, slots=True)
class CostParams:
    compute_efficiency: float = 0.6  # achieved / peak FLOP/s for the matmuls
    bandwidth_efficiency: float = 0.8  # achieved / peak HBM bandwidth
    step_overhead_s: float = 0.0005  # scheduling, launches and sampling per step


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([BM])\b")


def _params_from_note(note: str) -> tuple[float, float] | None:
    sizes = [float(v) * (1e9 if unit == "B" else 1e6) for v, unit in _SIZE.findall(note)]
    if not sizes:
        return None
    active = sizes[1] if "active" in note and len(sizes) > 1 else sizes[0]
    return sizes[0], active


def _estimate_params(cfg: Mapping[str, Any]) -> tuple[float, float]:
    hidden = cfg.get("hidden_size") or cfg.get("d_model")
    layers = cfg.get("num_hidden_layers") or cfg.get("n_layer")
    if not hidden or not layers:
        raise ValueError("config has no hidden_size / num_hidden_layers to estimate params")
    h, n = float(hidden), float(layers)
    vocab = float(cfg.get("vocab_size") or 32000)
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings", True) else 2)
    experts = cfg.get("num_experts") or cfg.get("n_routed_experts")
    if experts:
        moe_inter = float(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or h)
        shared = 3 * h * float(cfg.get("shared_expert_intermediate_size") or 0)
        top_k = float(cfg.get("num_experts_per_tok") or 1)
        total_mlp = float(experts) * 3 * h * moe_inter + shared
        active_mlp = top_k * 3 * h * moe_inter + shared
    else:
        total_mlp = active_mlp = 3 * h * float(cfg.get("intermediate_size") or 8 * h / 3)
    base = n * 4 * h * h + embed
    return base + n * total_mlp, base + n * active_mlp


def model_cost(raw_config: Mapping[str, Any], spec: ModelSpec) -> ModelCost:
    """Estimate a model's per-token costs from its config.json and its cache specs.

    Raises:
        ValueError: the config has neither a size note nor the fields of the estimate.
    """
    cfg = flatten_text_config(raw_config)
    note = cfg.get("total_params")
    noted = _params_from_note(note) if isinstance(note, str) else None
    total, active = noted or _estimate_params(cfg)
    num_q_heads = float(cfg.get("num_attention_heads") or 0)
    attn = 0.0
    recurrent = 0.0
    for layer in spec.layers:
        if isinstance(layer.spec, AttentionSpec | SlidingWindowSpec):
            heads = num_q_heads or layer.spec.num_kv_heads
            attn += 2 * heads * (layer.spec.head_dim + layer.spec.value_head_dim)
        elif isinstance(layer.spec, RecurrentStateSpec):
            recurrent += 4 * sum(math.prod(t.shape) for t in layer.spec.tensors)
    return ModelCost(
        total_params=total,
        active_params=active,
        params_source="config note" if noted else "estimate",
        attn_flops_per_pair=attn,
        recurrent_flops_per_token=recurrent,
        kv_bytes_per_token=spec.kv_bytes_per_token,
        state_bytes_per_seq=spec.state_bytes_per_seq,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class StepCost:
    seconds: float
    flops: float
    num_bytes: float


class CostModel:
    """Step times of one model on one GPU."""

    def __init__(self, model: ModelCost, gpu: Gpu, params: CostParams | None = None) -> None:
        self.model = model
        self.gpu = gpu
        self.params = params or CostParams()

    def step(self, work: Sequence[tuple[int, int]], num_copies: int = 0) -> StepCost:
        """Cost of one step running ``work`` (``(ctx, n)`` per sequence) plus state copies."""
        m = self.model
        num_tokens = sum(n for _, n in work)
        flops = 2 * m.active_params * num_tokens + m.recurrent_flops_per_token * num_tokens
        flops += m.attn_flops_per_pair * sum(n * (ctx + n / 2) for ctx, n in work)
        # Each token of a MoE step touches its experts; a big batch touches them all.
        weight_params = min(m.total_params, m.active_params * max(1, num_tokens))
        num_bytes = WEIGHT_BYTES_PER_PARAM * weight_params
        num_bytes += m.kv_bytes_per_token * sum(ctx + 2 * n for ctx, n in work)
        num_bytes += 2 * m.state_bytes_per_seq * (len(work) + num_copies)
        p = self.params
        compute_s = flops / (self.gpu.peak_flops * p.compute_efficiency)
        memory_s = num_bytes / (self.gpu.hbm_bytes_per_s * p.bandwidth_efficiency)
        return StepCost(
            seconds=max(compute_s, memory_s) + p.step_overhead_s, flops=flops, num_bytes=num_bytes
        )

"""Self-attention over paged KV: project, (norm), RoPE, write K/V to pages, attend, (gate).

One module covers the attention layers of the hybrids: Qwen3-Next/3.5 (q/k zero-centred
norm, partial RoPE, sigmoid output gate folded into ``q_proj``), and, with the switches off,
Jamba (no RoPE), Falcon-H1, Zamba2 and LFM2 (q/k norm, out projection named differently: the
model remaps names on load).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from hybridkv.forward.batch import ForwardBatch
from hybridkv.forward.views import CacheViews
from hybridkv.layers.rope import RopeTables, RotaryEmbedding, apply_rope, apply_rope_
from hybridkv.ops.paged_attention import decode_key_multiple, paged_attention, store_kv


@dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """Shapes and switches of one attention layer."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int = 0  # 0: no RoPE
    rope_theta: float = 10000.0
    qk_norm: Callable[[int, float], nn.Module] | None = None  # per-head norm class
    norm_eps: float = 1e-6
    output_gate: bool = False  # Qwen3-Next: q_proj emits [query | gate] per head
    bias: bool = False
    scale: float | None = None  # default head_dim ** -0.5


class PagedAttention(nn.Module):
    """Causal GQA attention of one decoder layer, its KV in ``views.attn(layer_index)``."""

    def __init__(self, cfg: AttentionConfig, layer_index: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_index = layer_index
        q_out = cfg.num_heads * cfg.head_dim * (2 if cfg.output_gate else 1)
        kv_out = cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_out, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_out, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_out, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.bias)
        if cfg.qk_norm is not None:
            self.q_norm = cfg.qk_norm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = cfg.qk_norm(cfg.head_dim, cfg.norm_eps)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta) if cfg.rotary_dim else None
        self.scale = cfg.scale if cfg.scale is not None else cfg.head_dim**-0.5

    def project(
        self, x: Tensor, rope: RopeTables | None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], gate [T, Hq*D] | None), rotated by
        the step's ``rope`` tables when the layer has RoPE."""
        cfg, num_tokens = self.cfg, x.shape[0]
        q = self.q_proj(x).view(num_tokens, cfg.num_heads, -1)  # [T, Hq, D or 2D]
        gate = None
        if cfg.output_gate:
            q, gate = q.split(cfg.head_dim, dim=-1)  # [query | gate] per head
            gate = gate.reshape(num_tokens, -1)  # [T, Hq * D]
        k = self.k_proj(x).view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
                q, k = apply_rope(q, rope.cos, rope.sin), apply_rope(k, rope.cos, rope.sin)
            else:  # in place: q and k are this call's own tensors
                q, k = apply_rope_(q, rope), apply_rope_(k, rope)
        return q, k, v, gate

    def rope_tables(self, batch: ForwardBatch, dtype: torch.dtype) -> RopeTables | None:
        """The step's RoPE tables, computed by the first layer with these RoPE settings and
        reused by the others (they depend on the positions alone)."""
        rotary = self.rotary
        if rotary is None:
            return None
        key = ("rope", rotary.rotary_dim, rotary.theta, dtype)
        return batch.per_step(key, lambda: rotary.tables(batch.positions, dtype))

    def forward(self, x: Tensor, batch: ForwardBatch, views: CacheViews) -> Tensor:
        q, k, v, gate = self.project(x, self.rope_tables(batch, x.dtype))
        out = self.attend(q, k, v, batch, views)  # [T, Hq, D]
        out = out.reshape(x.shape[0], -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, batch: ForwardBatch, views: CacheViews
    ) -> Tensor:
        """Write this step's K/V to the pages, then attend over the request's prefix."""
        view = views.attn(self.layer_index)
        plan = batch.attention_plan(view, decode_key_multiple(q.dtype, q.device))
        store_kv(k, v, view.key, view.value, plan)
        return paged_attention(q, view.key, view.value, plan, self.scale)

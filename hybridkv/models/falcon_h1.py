"""Falcon-H1 (``falcon_h1``): attention and Mamba2 side by side in every layer, muP multipliers.

Each layer computes, from ``h = input_layernorm(x)``::

    x = x + ssm_out_m * mamba(ssm_in_m * h) + attn_out_m * attention(attn_in_m * h)
    x = x + down_m * down(up(x) * silu(gate_m * gate(x)))     # mlp_multipliers [gate, down]

and the model scales the embeddings by ``embedding_multiplier`` and the logits by
``lm_head_multiplier``. The Mamba2 projection is multiplied per section by ``ssm_multipliers``
(``[z | x | B | C | dt]``, transformers' ``mup_vector``) and the keys by ``key_multiplier``.
Every multiplier in front of or behind a linear map is folded into that map's weights on
load (:meth:`FalconH1ForCausalLM.split_weight`), so the layers run unchanged: the shared
:class:`~hybridkv.layers.mamba2.Mamba2Mixer` and :class:`~hybridkv.layers.attention.PagedAttention`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridkv.core.spec import ModelSpec
from hybridkv.forward.batch import ForwardBatch
from hybridkv.forward.views import CacheViews
from hybridkv.layers.attention import PagedAttention
from hybridkv.layers.mamba2 import Mamba2Config, Mamba2Mixer
from hybridkv.layers.mlp import GatedMLP
from hybridkv.layers.norm import RMSNorm, rms_normalize
from hybridkv.models.base import CausalLM
from hybridkv.models.common import attention_config_from
from hybridkv.ops.row_blocks import by_row_blocks


def _float(value: Any) -> float:
    """A config float; config.json may write infinity as ``{"__float__": "Infinity"}``."""
    return float(value["__float__"]) if isinstance(value, Mapping) else float(value)


def _multipliers(cfg: Mapping[str, Any], key: str, count: int) -> list[float]:
    value = cfg.get(key)
    return [1.0] * count if value is None else [float(v) for v in value]


def falcon_mamba_config(cfg: Mapping[str, Any]) -> Mamba2Config:
    hidden, heads = int(cfg["hidden_size"]), int(cfg.get("mamba_n_heads", 128))
    d_ssm = cfg.get("mamba_d_ssm")
    inner = int(d_ssm) if d_ssm else int(cfg.get("mamba_expand", 2)) * hidden
    d_head = cfg.get("mamba_d_head", "auto")
    limit = cfg.get("time_step_limit") or (0.0, math.inf)
    if bool(cfg.get("mamba_proj_bias", False)) != bool(cfg.get("projectors_bias", False)):
        raise NotImplementedError("mamba_proj_bias != projectors_bias is not supported")
    return Mamba2Config(
        hidden_size=hidden,
        num_heads=heads,
        head_dim=inner // heads if d_head == "auto" else int(d_head),
        d_state=int(cfg.get("mamba_d_state", 256)),
        n_groups=int(cfg.get("mamba_n_groups", 1)),
        conv_kernel=int(cfg.get("mamba_d_conv", 4)),
        chunk_size=int(cfg.get("mamba_chunk_size", 256)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        activation=str(cfg.get("hidden_act", "silu")),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        dt_limit=(_float(limit[0]), _float(limit[1])),
    )


class SiluGate(nn.Module):
    """``y * silu(z)`` with no norm (Falcon-H1 with ``mamba_rms_norm`` off)."""

    def forward(self, y: Tensor, gate: Tensor) -> Tensor:
        return (y.float() * F.silu(gate.float())).to(y.dtype)


class FalconGatedRMSNorm(nn.Module):
    """Falcon-H1's grouped output norm (``mamba_rms_norm``), gate before or after the norm.

    ``norm_before_gate`` (the default): ``w * rms_norm_G(y) * silu(z)``; otherwise
    ``w * rms_norm_G(y * silu(z))``. Unlike Bamba's norm, the weight multiplies in fp32 and
    the result is cast once at the end, as ``FalconH1RMSNormGated`` does (matters in bf16).
    """

    def __init__(self, dim: int, group_size: int, eps: float, norm_before_gate: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size, self.eps = group_size, eps
        self.norm_before_gate = norm_before_gate

    def forward(self, y: Tensor, gate: Tensor) -> Tensor:
        return by_row_blocks(self._norm, y, gate)

    def _norm(self, y: Tensor, gate: Tensor) -> Tensor:
        h, silu_gate = y.float(), F.silu(gate.float())
        if not self.norm_before_gate:
            h = h * silu_gate
        groups = h.view(*h.shape[:-1], -1, self.group_size)  # [T, G, I/G]
        h = rms_normalize(groups, self.eps).view_as(h)
        h = self.weight * h
        if self.norm_before_gate:
            h = h * silu_gate
        return h.to(y.dtype)


def falcon_mamba(cfg: Mapping[str, Any], layer_index: int) -> Mamba2Mixer:
    """The shared Mamba2 mixer with Falcon-H1's output norm variant swapped in."""
    mcfg = falcon_mamba_config(cfg)
    mixer = Mamba2Mixer(mcfg, layer_index)
    if not cfg.get("mamba_rms_norm", False):
        mixer.norm = SiluGate()
    else:
        before = cfg.get("mamba_norm_before_gate")
        mixer.norm = FalconGatedRMSNorm(
            mcfg.inner_size,
            mcfg.inner_size // mcfg.n_groups,
            mcfg.norm_eps,
            norm_before_gate=True if before is None else bool(before),
        )
    return mixer


class FalconH1DecoderLayer(nn.Module):
    """Attention ∥ Mamba2 on the same normed input, summed into the residual; then the MLP."""

    def __init__(self, cfg: Mapping[str, Any], layer_index: int) -> None:
        super().__init__()
        hidden, eps = int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-5))
        self.mamba = falcon_mamba(cfg, layer_index)
        self.self_attn = PagedAttention(attention_config_from(cfg), layer_index)
        self.feed_forward = GatedMLP(
            hidden,
            int(cfg["intermediate_size"]),
            str(cfg.get("hidden_act", "silu")),
            bias=bool(cfg.get("mlp_bias", False)),
        )
        self.input_layernorm = RMSNorm(hidden, eps)
        self.pre_ff_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: Tensor, batch: ForwardBatch, views: CacheViews) -> Tensor:
        h = self.input_layernorm(x)
        x = x + self.mamba(h, batch, views) + self.self_attn(h, batch, views)
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class FalconH1ForCausalLM(CausalLM):
    def __init__(self, cfg: Mapping[str, Any], spec: ModelSpec) -> None:
        super().__init__(cfg, spec)
        hidden, eps = int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-5))
        layers = [FalconH1DecoderLayer(cfg, i) for i in range(spec.num_layers)]
        self.build_model(layers, RMSNorm(hidden, eps))
        self.embedding_multiplier = float(cfg.get("embedding_multiplier", 1.0))
        self.lm_head_multiplier = float(cfg.get("lm_head_multiplier", 1.0))

    def embed(self, batch: ForwardBatch) -> Tensor:
        return self.model.embed_tokens(batch.input_ids) * self.embedding_multiplier

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return (self.lm_head(hidden) * self.lm_head_multiplier).float()

    def remap_weight_name(self, name: str) -> str | None:
        return name.replace("model.final_layernorm.", "model.norm.")

    def weight_scale(self, name: str) -> Tensor | float:
        """The factor folded into one tensor: rows of [out, in] weights and their biases."""
        cfg = self.cfg
        leaf = ".".join(name.split(".")[-3:])  # e.g. "mamba.in_proj.weight"
        attn_in = float(cfg.get("attention_in_multiplier", 1.0))
        gate_m, down_m = _multipliers(cfg, "mlp_multipliers", 2)
        weight_scales = {
            "self_attn.q_proj.weight": attn_in,
            "self_attn.k_proj.weight": attn_in * float(cfg.get("key_multiplier", 1.0)),
            "self_attn.v_proj.weight": attn_in,
        }
        both_scales = {
            "self_attn.k_proj": float(cfg.get("key_multiplier", 1.0)),
            "self_attn.o_proj": float(cfg.get("attention_out_multiplier", 1.0)),
            "mamba.out_proj": float(cfg.get("ssm_out_multiplier", 1.0)),
            "feed_forward.gate_proj": gate_m,
            "feed_forward.down_proj": down_m,
        }
        if leaf in weight_scales:
            return weight_scales[leaf]
        module, kind = leaf.rsplit(".", 1)
        if module == "mamba.in_proj":
            mup = self.mup_vector()
            ssm_in = float(cfg.get("ssm_in_multiplier", 1.0))
            return mup[:, None] * ssm_in if kind == "weight" else mup
        return both_scales.get(module, 1.0)

    def mup_vector(self) -> Tensor:
        """[2I + 2GN + H] per-row scale of the Mamba2 in_proj: ``[z | x | B | C | dt]``."""
        mcfg = falcon_mamba_config(self.cfg)
        gn = mcfg.n_groups * mcfg.d_state
        sizes = [mcfg.inner_size, mcfg.inner_size, gn, gn, mcfg.num_heads]
        mults = _multipliers(self.cfg, "ssm_multipliers", 5)
        return torch.cat([torch.full((n,), m) for n, m in zip(sizes, mults, strict=True)])

    def split_weight(self, name: str, tensor: Tensor) -> Iterable[tuple[str, Tensor]]:
        scale = self.weight_scale(name)
        yield name, tensor if isinstance(scale, float) and scale == 1.0 else tensor * scale

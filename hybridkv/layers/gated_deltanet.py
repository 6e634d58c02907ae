"""Gated DeltaNet mixer (Qwen3-Next, Qwen3.5): conv over [q|k|v], delta rule, gated norm.

Per layer and request the state page holds ``conv`` [2*Hk*Dk + Hv*Dv, K-1] and ``ssm``
[Hv, Dk, Dv]. The two families differ only in how the input projections are packed, so a
subclass supplies :meth:`GatedDeltaNet.project`::

    Qwen3-Next  in_proj_qkvz: per k-head group [q | k | v (r heads) | z (r heads)], r = Hv/Hk
                in_proj_ba:   per k-head group [b (r) | a (r)]
                (checkpoint layout; reordered to flat rows at load, see the class)
    Qwen3.5     in_proj_qkv [q | k | v], in_proj_z, in_proj_b, in_proj_a (flat)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from hybridkv.forward.batch import ForwardBatch
from hybridkv.forward.views import CacheViews
from hybridkv.layers.norm import GatedRMSNorm
from hybridkv.ops.causal_conv1d import causal_conv1d_varlen
from hybridkv.ops.causal_conv1d.packaged import Signature as ConvSignature
from hybridkv.ops.causal_conv1d.packaged import warm_up_conv
from hybridkv.ops.gated_delta_rule import gated_delta_rule_varlen
from hybridkv.ops.gated_delta_rule.mixer_decode import (
    MixerWeights,
    gated_deltanet_decode,
    gates,
    warm_up_mixer_decode,
)
from hybridkv.ops.gated_delta_rule.packaged_chunks import Signature, warm_up_chunks
from hybridkv.ops.paged_state import needs_grad


@dataclass(frozen=True, kw_only=True)
class GDNConfig:
    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int = 4
    norm_eps: float = 1e-6

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


class GatedDeltaNet(nn.Module):
    """The shared body; subclasses define the input projections."""

    def __init__(self, cfg: GDNConfig, layer_index: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_index = layer_index
        self.conv1d = nn.Conv1d(
            cfg.conv_dim, cfg.conv_dim, cfg.conv_kernel, groups=cfg.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(cfg.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(cfg.num_v_heads))
        self.norm = GatedRMSNorm(cfg.v_head_dim, cfg.norm_eps)
        self.out_proj = nn.Linear(cfg.value_dim, cfg.hidden_size, bias=False)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x [T, H] -> (qkv [T, conv_dim] as [q|k|v], z [T, Hv, Dv], b [T, Hv], a [T, Hv])."""
        raise NotImplementedError

    def warm_up_compiled(self, views: CacheViews) -> None:
        """Compile this layer's compiled ops for its cache layout (the model runner calls it
        once, before serving; hybridkv.ops.compiled)."""
        state = views.state(self.layer_index)
        weights = self.mixer_weights()
        warm_up_mixer_decode(state["conv"], state["ssm"], weights)
        cfg, dtype = self.cfg, weights.conv.dtype  # the projections' dtype
        device = state["ssm"].device.type
        warm_up_conv(ConvSignature(dtype, dtype, cfg.conv_dim, cfg.conv_kernel, True, device))
        warm_up_chunks(
            Signature(
                (dtype, dtype, dtype, torch.float32, dtype),  # q, k, v, g (fp32), beta
                cfg.num_k_heads,
                cfg.k_head_dim,
                cfg.num_v_heads,
                cfg.v_head_dim,
                device,
            )
        )

    def mixer_weights(self) -> MixerWeights:
        """The parameters the fused decode step reads."""
        return MixerWeights(
            self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight, self.norm.eps
        )

    def forward(self, x: Tensor, batch: ForwardBatch, views: CacheViews) -> Tensor:
        """Decodes (one-token requests) run the fused decode step, in every step
        (:mod:`hybridkv.ops.gated_delta_rule.mixer_decode`: a token's result must not
        depend on what shares its step); the other requests the varlen conv, the chunked
        delta rule and the gated norm. Training (autograd) runs every request through the
        varlen ops' differentiable paths."""
        cfg, num_tokens = self.cfg, x.shape[0]
        state = views.state(self.layer_index)
        states = batch.state_batch(state.group_id)
        qkv, z, b, a = self.project(x)
        decodes, weights = states.decodes, self.mixer_weights()
        fused = decodes is not None and not needs_grad(qkv, z, b, a, *weights[:4])
        decoded = None
        if fused:
            assert decodes is not None
            decoded = gated_deltanet_decode(
                qkv, z, b, a, decodes, state["conv"], state["ssm"], weights
            )
            if decodes.rows.numel() == num_tokens:  # a decode-only step
                states.copy_final_captures(state["conv"])
                states.copy_final_captures(state["ssm"])
                return self.out_proj(decoded)
        weight = self.conv1d.weight[:, 0, :]  # [C, K]
        qkv = causal_conv1d_varlen(qkv, state["conv"], states, weight, None, "silu", fused)
        q, k, v = qkv.split([cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        q = q.reshape(num_tokens, cfg.num_k_heads, cfg.k_head_dim)
        k = k.reshape(num_tokens, cfg.num_k_heads, cfg.k_head_dim)
        v = v.reshape(num_tokens, cfg.num_v_heads, cfg.v_head_dim)
        g, beta = gates(a, b, self.A_log, self.dt_bias)  # [T, Hv] each
        o = gated_delta_rule_varlen(q, k, v, g, beta, state["ssm"], states, skip_decodes=fused)
        o = self.norm(o.reshape(-1, cfg.v_head_dim), z.reshape(-1, cfg.v_head_dim))
        o = o.reshape(num_tokens, cfg.value_dim)
        if decoded is not None:  # a mixed step: the decodes' rows (whose conv the
            assert decodes is not None  # block path skipped) from the fused step
            states.copy_final_captures(state["conv"])
            o = o.index_copy(0, decodes.rows, decoded)
        return self.out_proj(o)


class Qwen3NextGatedDeltaNet(GatedDeltaNet):
    """Fused projections ``in_proj_qkvz`` and ``in_proj_ba``, their rows reordered at load.

    The checkpoint groups the rows by k-head (module doc); :meth:`flat_rows` reorders them
    once to ``[q | k | v | z]`` and ``[b | a]``, heads in order inside each, so that the
    projection's output splits into views. Regrouping the output every call instead cost
    three copies and a concatenation of [T, conv_dim] per layer (~7 ms of a 4096-token
    prefill layer of the small Qwen3-Next).
    """

    def __init__(self, cfg: GDNConfig, layer_index: int) -> None:
        super().__init__(cfg, layer_index)
        self.in_proj_qkvz = nn.Linear(
            cfg.hidden_size, 2 * cfg.key_dim + 2 * cfg.value_dim, bias=False
        )
        self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * cfg.num_v_heads, bias=False)

    def flat_rows(self, projection: str, weight: Tensor) -> Tensor:
        """The checkpoint's head-grouped ``in_proj_qkvz`` / ``in_proj_ba`` weight with its
        rows in the flat order :meth:`project` reads."""
        cfg = self.cfg
        r = cfg.num_v_heads // cfg.num_k_heads
        if projection == "in_proj_qkvz":
            sizes = [cfg.k_head_dim, cfg.k_head_dim, r * cfg.v_head_dim, r * cfg.v_head_dim]
        elif projection == "in_proj_ba":
            sizes = [r, r]
        else:
            raise ValueError(f"no grouped rows in {projection!r}")
        grouped = weight.view(cfg.num_k_heads, sum(sizes), weight.shape[-1])
        parts = grouped.split(sizes, dim=1)  # each [Hk, rows per head, H]
        return torch.cat([part.reshape(-1, weight.shape[-1]) for part in parts])

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        cfg, num_tokens = self.cfg, x.shape[0]
        qkv, z = self.in_proj_qkvz(x).split([cfg.conv_dim, cfg.value_dim], dim=-1)
        b, a = self.in_proj_ba(x).split([cfg.num_v_heads, cfg.num_v_heads], dim=-1)
        return qkv, z.view(num_tokens, cfg.num_v_heads, cfg.v_head_dim), b, a


class Qwen35GatedDeltaNet(GatedDeltaNet):
    """Separate flat projections ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``."""

    def __init__(self, cfg: GDNConfig, layer_index: int) -> None:
        super().__init__(cfg, layer_index)
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, cfg.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, cfg.value_dim, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, cfg.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, cfg.num_v_heads, bias=False)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        z = self.in_proj_z(x).view(x.shape[0], self.cfg.num_v_heads, self.cfg.v_head_dim)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)

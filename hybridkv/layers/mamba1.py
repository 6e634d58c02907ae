"""Mamba1 mixer over a flat token batch, its conv and SSM states in the request's state page.

The block of Jamba (and pure Mamba / FalconMamba)::

    in_proj(x) = [x | z]                       # [T, 2I]
    x = silu(causal_conv1d(x))                 # conv state: last K-1 inputs, [I, K-1]
    x_proj(x) = [dt | B | C]                   # [T, R + 2N]; Jamba RMS-norms each part
    dt = dt_proj.weight @ dt                   # [T, I]; dt_proj.bias is added in the scan
    y = selective_scan(x, dt, A, B, C, D, z)   # SSM state: [I, N]
    out = out_proj(y)

Both states are read from and written to the request's live page in place; a request whose
``has_initial_state`` is False starts from zeros. Parameter names are the Hugging Face ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridkv.forward.batch import ForwardBatch
from hybridkv.forward.views import CacheViews
from hybridkv.layers.norm import RMSNorm
from hybridkv.layers.packed_linear import keep_plain
from hybridkv.ops.causal_conv1d import causal_conv1d_varlen
from hybridkv.ops.mamba1 import SelectiveScanParams, selective_scan_varlen


@dataclass(frozen=True, kw_only=True)
class Mamba1Config:
    """Sizes of one Mamba1 mixer, read from a model config by each model file."""

    hidden_size: int
    inner_size: int
    d_state: int
    dt_rank: int
    conv_kernel: int = 4
    conv_bias: bool = True
    proj_bias: bool = False
    dt_bc_norm: bool = False  # Jamba: RMSNorm on dt, B and C after x_proj
    norm_eps: float = 1e-6
    activation: str = "silu"


class Mamba1Mixer(nn.Module):
    """One Mamba1 layer's mixer: ``forward(x [T, hidden], batch, views) -> [T, hidden]``."""

    def __init__(self, cfg: Mamba1Config, layer_index: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_index = layer_index
        inner, n = cfg.inner_size, cfg.d_state
        self.in_proj = nn.Linear(cfg.hidden_size, 2 * inner, bias=cfg.proj_bias)
        self.conv1d = nn.Conv1d(inner, inner, cfg.conv_kernel, groups=inner, bias=cfg.conv_bias)
        self.x_proj = nn.Linear(inner, cfg.dt_rank + 2 * n, bias=False)
        self.dt_proj = keep_plain(nn.Linear(cfg.dt_rank, inner, bias=True))  # read by weight
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n + 1).float()).repeat(inner, 1))
        self.D = nn.Parameter(torch.ones(inner))
        self.out_proj = nn.Linear(inner, cfg.hidden_size, bias=cfg.proj_bias)
        if cfg.dt_bc_norm:
            self.dt_layernorm = RMSNorm(cfg.dt_rank, cfg.norm_eps)
            self.b_layernorm = RMSNorm(n, cfg.norm_eps)
            self.c_layernorm = RMSNorm(n, cfg.norm_eps)

    def forward(self, x: Tensor, batch: ForwardBatch, views: CacheViews) -> Tensor:
        cfg = self.cfg
        view = views.state(self.layer_index)
        states = batch.state_batch(view.group_id)
        xs, z = self.in_proj(x).chunk(2, dim=-1)  # [T, I] each
        xs = causal_conv1d_varlen(
            xs,
            view["conv"],
            states,
            self.conv1d.weight[:, 0, :],
            self.conv1d.bias,
            cfg.activation,
        )
        dt, B, C = self.x_proj(xs).split([cfg.dt_rank, cfg.d_state, cfg.d_state], dim=-1)
        if cfg.dt_bc_norm:
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        dt = F.linear(dt, self.dt_proj.weight)  # [T, I], bias added in the scan
        params = SelectiveScanParams(
            A=-torch.exp(self.A_log.float()), D=self.D, dt_bias=self.dt_proj.bias
        )
        y = selective_scan_varlen(xs, dt, B, C, z, params, view["ssm"], states)
        return self.out_proj(y.to(x.dtype))

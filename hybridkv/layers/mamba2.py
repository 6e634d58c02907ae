"""Mamba2 mixer over a flat token batch, its conv and SSM states in the request's state page.

The block of Bamba, NemotronH, GraniteMoeHybrid (and Zamba2 / Falcon-H1 later)::

    in_proj(x) = [z | xBC | dt]            # [T, I + (I + 2 G N) + H]
    xBC = silu(causal_conv1d(xBC))         # conv state: last K-1 inputs, [C, K-1]
    y   = SSD(x, dt, A, B, C) + D x        # SSM state: [H, P, N]
    out = out_proj(RMSNorm_G(y * silu(z))) # gate first, then norm per group of I/G channels

Both states are read from and written to the request's live page in place; a request
whose ``has_initial_state`` is False starts from zeros. Parameter names are the Hugging
Face ones (``mixer.in_proj.weight``, ``mixer.conv1d.weight`` ...).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridkv.core.spec import RecurrentStateSpec
from hybridkv.forward.batch import ForwardBatch
from hybridkv.forward.views import CacheViews
from hybridkv.layers.norm import rms_normalize
from hybridkv.ops.causal_conv1d import causal_conv1d_varlen
from hybridkv.ops.mamba2 import NO_DT_LIMIT, SSDParams, ssd_varlen
from hybridkv.ops.row_blocks import by_row_blocks


@dataclass(frozen=True, kw_only=True)
class Mamba2Config:
    """Sizes of one Mamba2 mixer, read from a model config by each model file."""

    hidden_size: int
    num_heads: int
    head_dim: int
    d_state: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    norm_eps: float = 1e-6
    activation: str = "silu"
    conv_bias: bool = True
    proj_bias: bool = False
    dt_limit: tuple[float, float] = (0.0, math.inf)
    # NemotronH in transformers clamps dt only in its chunked path, as mamba_ssm's step does
    clamp_dt_in_step: bool = True

    @classmethod
    def from_spec(cls, spec: RecurrentStateSpec, **options: Any) -> Mamba2Config:
        """Heads and sizes from the layer's cache spec, the rest (``hidden_size``, ...) as given.

        The core reads every family's Mamba2 keys once (``families._mamba2_geometry``); taking
        the geometry back from the spec keeps the module and its state pages in agreement.
        """
        shapes = {t.name: t.shape for t in spec.tensors}
        heads, head_dim, d_state = shapes["ssm"]
        channels, taps_kept = shapes["conv"]  # [C, K-1]
        n_groups = (channels - heads * head_dim) // (2 * d_state)
        return cls(
            num_heads=heads,
            head_dim=head_dim,
            d_state=d_state,
            n_groups=n_groups,
            conv_kernel=taps_kept + 1,
            **options,
        )

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        return self.inner_size + 2 * self.n_groups * self.d_state


def parse_dt_limit(value: Any) -> tuple[float, float]:
    """``time_step_limit`` as config.json writes it: None, or a pair whose infinity may be
    serialised as ``{"__float__": "Infinity"}``."""
    if value is None:
        return (0.0, math.inf)
    lo, hi = (float(v["__float__"]) if isinstance(v, Mapping) else float(v) for v in value)
    return (lo, hi)


class GroupedGatedRMSNorm(nn.Module):
    """Mamba2's output norm: ``w * rms_norm(x * silu(z))`` over groups of ``group_size``.

    Gate before norm (``norm_before_gate=False``) and one norm per group, as
    ``BambaRMSNormGated``; GDN's :class:`~hybridkv.layers.norm.GatedRMSNorm` gates after.
    """

    def __init__(self, dim: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        return by_row_blocks(self._norm, x, gate)

    def _norm(self, x: Tensor, gate: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.float() * F.silu(gate.float())  # [T, I]
        groups = h.view(*h.shape[:-1], -1, self.group_size)  # [T, G, I/G]
        groups = rms_normalize(groups, self.eps)
        return self.weight * groups.view_as(h).to(dtype)


class Mamba2Mixer(nn.Module):
    """One Mamba2 layer's mixer: ``forward(x [T, hidden], batch, views) -> [T, hidden]``."""

    def __init__(self, cfg: Mamba2Config, layer_index: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_index = layer_index
        channels = cfg.conv_channels
        self.in_proj = nn.Linear(
            cfg.hidden_size, cfg.inner_size + channels + cfg.num_heads, bias=cfg.proj_bias
        )
        self.conv1d = nn.Conv1d(
            channels, channels, cfg.conv_kernel, groups=channels, bias=cfg.conv_bias
        )  # weight [C, 1, K], as in the checkpoints
        self.dt_bias = nn.Parameter(torch.ones(cfg.num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, cfg.num_heads + 1).float()))
        self.D = nn.Parameter(torch.ones(cfg.num_heads))
        self.norm = GroupedGatedRMSNorm(
            cfg.inner_size, cfg.inner_size // cfg.n_groups, cfg.norm_eps
        )
        self.out_proj = nn.Linear(cfg.inner_size, cfg.hidden_size, bias=cfg.proj_bias)

    def forward(self, x: Tensor, batch: ForwardBatch, views: CacheViews) -> Tensor:
        cfg = self.cfg
        num_tokens = x.shape[0]
        view = views.state(self.layer_index)
        states = batch.state_batch(view.group_id)
        z, xBC, dt = self.in_proj(x).split(
            [cfg.inner_size, cfg.conv_channels, cfg.num_heads], dim=-1
        )  # [T, I], [T, C], [T, H]
        xBC = causal_conv1d_varlen(
            xBC,
            view["conv"],
            states,
            self.conv1d.weight[:, 0, :],
            self.conv1d.bias,
            cfg.activation,
        )
        xs, B, C = xBC.split([cfg.inner_size, *[cfg.n_groups * cfg.d_state] * 2], dim=-1)
        params = SSDParams(
            A=-torch.exp(self.A_log.float()),
            D=self.D,
            dt_bias=self.dt_bias,
            chunk_size=cfg.chunk_size,
            dt_limit=cfg.dt_limit,
            step_dt_limit=None if cfg.clamp_dt_in_step else NO_DT_LIMIT,
        )
        y = ssd_varlen(
            xs.reshape(num_tokens, cfg.num_heads, cfg.head_dim),
            dt,
            B.reshape(num_tokens, cfg.n_groups, cfg.d_state),
            C.reshape(num_tokens, cfg.n_groups, cfg.d_state),
            params,
            view["ssm"],
            states,
        )  # [T, H, P]
        y = self.norm(y.reshape(num_tokens, cfg.inner_size), z)  # [T, I]
        return self.out_proj(y.to(x.dtype))

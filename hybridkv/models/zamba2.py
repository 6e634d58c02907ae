"""Zamba2 (``zamba2``): Mamba2 layers, some of which first run a shared transformer block.

A ``hybrid`` layer computes, with ``e`` the input embeddings (Zamba2 paper, arXiv
2411.15242, fig. 2)::

    t = attn(input_layernorm(concat(x, e)))        # [T, 2H] in: q/k/v = shared W + own LoRA
    t = feed_forward(pre_ff_layernorm(t))          # [T, H], gate_up = shared W + own LoRA
    x = x + mamba(norm(x + linear(t)))             # linear, norm and mamba are the layer's own

and a ``linear_attention`` layer only ``x = x + mamba(norm(x))``. There are
``num_mem_blocks`` shared blocks: the c-th hybrid layer runs block ``c % num_mem_blocks``.
The blocks have no residual of their own, attend with scale ``(head_dim / 2) ** -0.5`` and
use RoPE only with ``use_mem_rope``. Every hybrid layer has its own KV cache (the ModelSpec
gives each one an attention layer cache under its own index), so a block is run by one
:class:`~hybridkv.layers.attention.PagedAttention` per hybrid layer whose projections are
the block's modules: shared weights are tied by module identity, appear once in
``named_parameters`` (under the block's first hybrid layer, where transformers stores them
too) and load from either that single copy or a copy repeated in every hybrid layer.

Layers are called ``layer(x, embeddings, batch, views)``: the hybrid ones need ``e``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hybridkv.core.spec import AttentionSpec, ModelSpec
from hybridkv.forward.batch import ForwardBatch
from hybridkv.forward.views import CacheViews
from hybridkv.layers.attention import AttentionConfig, PagedAttention
from hybridkv.layers.mlp import activation
from hybridkv.layers.norm import RMSNorm
from hybridkv.layers.rope import RotaryEmbedding
from hybridkv.models.base import CausalLM
from hybridkv.models.common import attention_config_from, mamba2_mixer, state_specs

# model.layers.<i>.shared_transformer.<rest> on disk
_SHARED = re.compile(r"model\.layers\.(\d+)\.shared_transformer\.(.+)")
# an invocation's adapter inside a block: <module>.<list>.<hybrid ordinal j>.<0 | 1>.weight
_ADAPTER = re.compile(
    r"(self_attn|feed_forward)\.(?:linear_([qkv])_adapter_list|gate_up_proj_adapter_list)"
    r"\.(\d+)\.([01]\.weight)"
)
_WITH_BASE = re.compile(r"(self_attn\.[qkv]_proj|feed_forward\.gate_up_proj)\.(weight|bias)")


class LoRALinear(nn.Module):
    """``base(x) + up(down(x))``: a shared projection plus one hybrid layer's adapter.

    ``adapter`` is an ``nn.Sequential(down, up)`` as in the checkpoints, or None when the
    config turns adapters off.
    """

    def __init__(self, base: nn.Linear, rank: int | None) -> None:
        super().__init__()
        self.base = base
        self.adapter: nn.Sequential | None = None
        if rank:
            self.adapter = nn.Sequential(
                nn.Linear(base.in_features, rank, bias=False),
                nn.Linear(rank, base.out_features, bias=False),
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.base(x)
        return out if self.adapter is None else out + self.adapter(x)


class Zamba2MLP(nn.Module):
    """``down(act(gate) * up)`` with ``[gate | up] = gate_up_proj(x)``."""

    def __init__(self, gate_up_proj: LoRALinear, down_proj: nn.Linear, act: str) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.act = activation(act)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(self.act(gate) * up)


@dataclass(frozen=True, slots=True)
class SharedBlock:
    """The modules of one shared transformer block, before any hybrid layer holds them."""

    input_layernorm: RMSNorm
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear
    rotary: RotaryEmbedding | None
    pre_ff_layernorm: RMSNorm
    gate_up_proj: nn.Linear
    down_proj: nn.Linear

    @classmethod
    def build(cls, cfg: Mapping[str, Any], attn: AttentionConfig) -> SharedBlock:
        hidden, eps = int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-5))
        intermediate = int(cfg.get("intermediate_size") or 4 * hidden)
        bias = bool(cfg.get("add_bias_linear", False))
        q_out, kv_out = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        return cls(
            input_layernorm=RMSNorm(attn.hidden_size, eps),
            q_proj=nn.Linear(attn.hidden_size, q_out, bias=False),
            k_proj=nn.Linear(attn.hidden_size, kv_out, bias=False),
            v_proj=nn.Linear(attn.hidden_size, kv_out, bias=False),
            o_proj=nn.Linear(q_out, hidden, bias=False),
            rotary=RotaryEmbedding(attn.rotary_dim, attn.rope_theta) if attn.rotary_dim else None,
            pre_ff_layernorm=RMSNorm(hidden, eps),
            gate_up_proj=nn.Linear(hidden, 2 * intermediate, bias=bias),
            down_proj=nn.Linear(intermediate, hidden, bias=bias),
        )


class Zamba2SharedTransformer(nn.Module):
    """One hybrid layer's run of a shared block: its own KV cache and adapters, shared weights."""

    def __init__(
        self, block: SharedBlock, attn: AttentionConfig, layer_index: int, cfg: Mapping[str, Any]
    ) -> None:
        super().__init__()
        rank = int(cfg.get("adapter_rank", 128))
        attn_rank = rank if cfg.get("use_shared_attention_adapter", False) else None
        mlp_rank = rank if cfg.get("use_shared_mlp_adapter", True) else None  # transformers: always
        self.input_layernorm = block.input_layernorm
        with torch.device("meta"):  # every projection is replaced by the block's below
            self.self_attn = PagedAttention(attn, layer_index)
        placeholders = [*self.self_attn.parameters(), *self.self_attn.buffers()]  # kept alive
        self.self_attn.q_proj = LoRALinear(block.q_proj, attn_rank)
        self.self_attn.k_proj = LoRALinear(block.k_proj, attn_rank)
        self.self_attn.v_proj = LoRALinear(block.v_proj, attn_rank)
        self.self_attn.o_proj = block.o_proj
        self.self_attn.rotary = block.rotary
        self.pre_ff_layernorm = block.pre_ff_layernorm
        self.feed_forward = Zamba2MLP(
            LoRALinear(block.gate_up_proj, mlp_rank),
            block.down_proj,
            str(cfg.get("hidden_act", "gelu")),
        )
        # (identity, not is_meta: the loader builds every parameter on meta until it loads)
        leftover = [
            n
            for n, t in (*self.named_parameters(), *self.named_buffers())
            if any(t is p for p in placeholders)
        ]
        if leftover:
            raise AssertionError(f"unshared modules left on the meta device: {leftover}")

    def forward(
        self, x: Tensor, embeddings: Tensor, batch: ForwardBatch, views: CacheViews
    ) -> Tensor:
        h = self.input_layernorm(torch.cat([x, embeddings], dim=-1))  # [T, 2H]
        h = self.self_attn(h, batch, views)  # [T, H]
        return self.feed_forward(self.pre_ff_layernorm(h))


class Zamba2MambaDecoderLayer(nn.Module):
    """``x + mamba(norm(x + t))``; ``t`` is the shared block's projected output, or nothing."""

    def __init__(self, mamba: nn.Module, hidden: int, eps: float) -> None:
        super().__init__()
        self.mamba = mamba
        self.input_layernorm = RMSNorm(hidden, eps)

    def forward(
        self,
        x: Tensor,
        embeddings: Tensor,
        batch: ForwardBatch,
        views: CacheViews,
        transformer_out: Tensor | None = None,
    ) -> Tensor:
        h = x if transformer_out is None else x + transformer_out
        return x + self.mamba(self.input_layernorm(h), batch, views)


class Zamba2HybridLayer(nn.Module):
    """Shared block, ``linear`` back to the residual stream, then the layer's Mamba2."""

    def __init__(self, shared: Zamba2SharedTransformer, mamba: Zamba2MambaDecoderLayer) -> None:
        super().__init__()
        hidden = mamba.input_layernorm.weight.shape[0]
        self.shared_transformer = shared
        self.linear = nn.Linear(hidden, hidden, bias=False)
        self.mamba_decoder = mamba

    def forward(
        self, x: Tensor, embeddings: Tensor, batch: ForwardBatch, views: CacheViews
    ) -> Tensor:
        t = self.linear(self.shared_transformer(x, embeddings, batch, views))  # [T, H]
        return self.mamba_decoder(x, embeddings, batch, views, transformer_out=t)


def zamba2_attention_config(cfg: Mapping[str, Any], kv: AttentionSpec) -> AttentionConfig:
    """Attention over ``2 * hidden``; heads and head size from the layer's KV spec."""
    head_dim = kv.head_dim  # 2 * hidden / heads (core: ``attention_head_dim``)
    no_rope = {} if cfg.get("use_mem_rope", False) else {"rotary_dim": 0}
    return attention_config_from(
        cfg,
        head_dim=head_dim,
        hidden_size=2 * int(cfg["hidden_size"]),
        num_kv_heads=kv.num_kv_heads,
        scale=(head_dim / 2) ** -0.5,  # Zamba2Attention: sqrt(head_dim / 2)
        bias=False,
        **no_rope,
    )


class Zamba2ForCausalLM(CausalLM):
    """``zamba2``: tied embeddings, final norm ``model.final_layernorm`` on disk."""

    def __init__(self, cfg: Mapping[str, Any], spec: ModelSpec) -> None:
        super().__init__(cfg, spec)
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", True))
        hidden, eps = int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-5))
        states = state_specs(spec)
        kv = {c.layer_index: c.spec for c in spec.layers if c.name == "attn"}
        self.hybrid_layers = sorted(kv)  # the c-th hybrid layer runs block c % num_mem_blocks
        self.num_mem_blocks = int(cfg.get("num_mem_blocks", 1))
        blocks: list[SharedBlock] = []
        layers: list[nn.Module] = []
        for i in range(spec.num_layers):
            mamba = Zamba2MambaDecoderLayer(self._mixer(states[i], i), hidden, eps)
            if i not in kv:
                layers.append(mamba)
                continue
            spec_i = kv[i]
            if not isinstance(spec_i, AttentionSpec):
                raise ValueError(f"zamba2 layer {i}: expected full attention, got {spec_i}")
            attn = zamba2_attention_config(cfg, spec_i)
            ordinal = self.hybrid_layers.index(i)
            if ordinal < self.num_mem_blocks:
                blocks.append(SharedBlock.build(cfg, attn))
            shared = Zamba2SharedTransformer(blocks[ordinal % self.num_mem_blocks], attn, i, cfg)
            layers.append(Zamba2HybridLayer(shared, mamba))
        self.build_model(layers, RMSNorm(hidden, eps))

    def _mixer(self, state: Any, index: int) -> nn.Module:
        """Zamba2MambaMixer: conv bias always on, norm eps fixed at 1e-5, dt clamped as
        NemotronH (``time_step_min`` in the chunked scan only)."""
        cfg = self.cfg
        return mamba2_mixer(
            cfg,
            state,
            index,
            chunk_size=int(cfg.get("chunk_size", 256)),
            norm_eps=1e-5,
            activation="silu",
            conv_bias=True,
            proj_bias=bool(cfg.get("add_bias_linear", False)),
            dt_limit=(float(cfg.get("time_step_min", 0.001)), float("inf")),
            clamp_dt_in_step=False,
        )

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, views: CacheViews) -> Tensor:
        """As :meth:`CausalLM.forward`, with the embeddings passed to every layer."""
        embeddings = self.embed(batch)  # [T, H]
        hidden = embeddings
        for layer in self.model.layers:
            hidden = layer(hidden, embeddings, batch, views)
        hidden = self.model.norm(hidden[batch.logits_indices])  # [R, H]
        return self.compute_logits(hidden)

    # ------------------------------------------------------------------ weights

    def remap_weight_name(self, name: str) -> str | None:
        """Shared-block names -> the block's first hybrid layer, adapters -> their layer.

        A block on disk is ``model.layers.<i>.shared_transformer.*`` with the adapters of
        all its invocations in lists indexed by hybrid ordinal ``j``; the copy may sit under
        the block's first hybrid layer only or under every hybrid layer using it.
        """
        if name.startswith("model.final_layernorm."):
            return "model.norm." + name.removeprefix("model.final_layernorm.")
        match = _SHARED.fullmatch(name)
        if match is None:
            return name
        layer, rest = int(match[1]), match[2]
        if layer not in self.hybrid_layers:
            raise KeyError(f"checkpoint tensor {name!r}: layer {layer} is not a hybrid layer")
        block = self.hybrid_layers.index(layer) % self.num_mem_blocks
        adapter = _ADAPTER.fullmatch(rest)
        if adapter is not None:
            module, qkv, ordinal, leaf = adapter.groups()
            if int(ordinal) % self.num_mem_blocks != block:
                raise KeyError(f"checkpoint tensor {name!r}: adapter {ordinal} is not in block")
            proj = f"{qkv}_proj" if qkv else "gate_up_proj"
            owner = self.hybrid_layers[int(ordinal)]
            return f"model.layers.{owner}.shared_transformer.{module}.{proj}.adapter.{leaf}"
        rest = _WITH_BASE.sub(r"\1.base.\2", rest)
        return f"model.layers.{self.hybrid_layers[block]}.shared_transformer.{rest}"

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Load by name; a shared tensor stored once per hybrid layer loads once.

        Raises:
            ValueError: two stored copies of one shared tensor differ.
        """
        params = dict(self.named_parameters())
        seen: set[str] = set()

        def first_copies() -> Iterable[tuple[str, Tensor]]:
            for raw_name, tensor in weights:
                name = self.remap_weight_name(raw_name)
                if name is None or name not in params or name not in seen:
                    seen.add(name or raw_name)
                    yield raw_name, tensor
                    continue
                if not torch.equal(params[name].data, tensor.to(params[name].dtype)):
                    raise ValueError(f"{raw_name}: differs from another copy of {name}")

        super().load_weights(first_copies())

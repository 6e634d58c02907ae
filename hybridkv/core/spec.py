"""Layer cache specs: what one layer keeps per token (attention) or per sequence (state).

Specs are plain numbers. The core never sees a tensor; dtypes travel as names
(``"bfloat16"``) whose byte widths come from ``DTYPE_BYTES``, so the engine can build
typed views of the arena and the planner can count bytes from the same object.

Layers with equal specs form a :class:`GroupSpec`. A group's *page* holds the data of
all its layers: ``block_tokens`` tokens of K and V for an attention group, one full
state (one snapshot) for a recurrent group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import TypeAlias

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

_DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp8": "float8_e4m3fn",
}


def canonical_dtype(name: str) -> str:
    """Normalise a dtype name (``"bf16"``, ``"torch.bfloat16"``) to a key of DTYPE_BYTES.

    Raises:
        ValueError: the name is not a dtype the cache can store.
    """
    key = name.removeprefix("torch.").lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        known = ", ".join(sorted(DTYPE_BYTES))
        raise ValueError(f"unknown dtype {name!r} (known: {known})")
    return key


def dtype_bytes(name: str) -> int:
    return DTYPE_BYTES[canonical_dtype(name)]


class StateKind(Enum):
    """The recurrent mixer a state belongs to (for display and for the model loader)."""

    MAMBA1 = "mamba1"
    MAMBA2 = "mamba2"
    GATED_DELTANET = "gdn"
    SHORT_CONV = "short_conv"
    KDA = "kda"


@dataclass(frozen=True, kw_only=True, slots=True)
class AttentionSpec:
    """Full attention: K and V of every token stay for the whole sequence.

    ``value_head_dim`` differs from ``head_dim`` for MLA, whose cache is the latent:
    Kimi-Linear stores ``kv_lora_rank`` as "K" and ``qk_rope_head_dim`` as "V" in one head.
    """

    num_kv_heads: int
    head_dim: int
    value_head_dim: int
    dtype: str

    @property
    def bytes_per_token(self) -> int:
        """K + V bytes of one token in one layer."""
        return self.num_kv_heads * (self.head_dim + self.value_head_dim) * dtype_bytes(self.dtype)

    @property
    def label(self) -> str:
        return "attention"


@dataclass(frozen=True, kw_only=True, slots=True)
class SlidingWindowSpec:
    """Attention that only looks back ``window_tokens``: older blocks can be released."""

    num_kv_heads: int
    head_dim: int
    value_head_dim: int
    dtype: str
    window_tokens: int

    @property
    def bytes_per_token(self) -> int:
        return self.num_kv_heads * (self.head_dim + self.value_head_dim) * dtype_bytes(self.dtype)

    @property
    def label(self) -> str:
        return f"sliding_window({self.window_tokens})"


@dataclass(frozen=True, kw_only=True, slots=True)
class StateTensorSpec:
    """One tensor of a recurrent state, e.g. the conv state ``[channels, kernel - 1]``."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * dtype_bytes(self.dtype)


@dataclass(frozen=True, kw_only=True, slots=True)
class RecurrentStateSpec:
    """One Mamba/GDN/conv layer's state; a snapshot is valid only at its exact token."""

    kind: StateKind
    tensors: tuple[StateTensorSpec, ...]

    @property
    def bytes_per_seq(self) -> int:
        return sum(t.num_bytes for t in self.tensors)

    @property
    def label(self) -> str:
        return self.kind.value


Spec: TypeAlias = AttentionSpec | SlidingWindowSpec | RecurrentStateSpec
TokenSpec: TypeAlias = AttentionSpec | SlidingWindowSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerCache:
    """One cache a model layer owns. A layer may own two (Falcon-H1: attention ∥ Mamba)."""

    layer_index: int  # 0-based decoder layer
    name: str  # "attn" or "state": which cache of that layer
    spec: Spec
    draft: bool = False  # a layer of the speculative draft model (see with_draft)


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupSpec:
    """Layers with one spec, sharing pages: page = their data side by side, in layer order."""

    group_id: int
    spec: Spec
    layers: tuple[LayerCache, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def is_recurrent(self) -> bool:
        return isinstance(self.spec, RecurrentStateSpec)

    @property
    def is_draft(self) -> bool:
        """The group holds draft-model layers (never mixed with the target's)."""
        return self.layers[0].draft

    def page_bytes(self, block_tokens: int) -> int:
        """Bytes of one page: one block of every layer, or one state of every layer."""
        if isinstance(self.spec, RecurrentStateSpec):
            return self.spec.bytes_per_seq * self.num_layers
        return self.spec.bytes_per_token * block_tokens * self.num_layers

    def block_tokens(self, block_tokens: int) -> int | None:
        """Tokens one page covers; None for a recurrent group (one page per sequence)."""
        return None if self.is_recurrent else block_tokens


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """Everything the memory core needs to know about a model."""

    name: str
    model_type: str
    num_layers: int
    dtype: str
    max_model_len: int | None
    layers: tuple[LayerCache, ...]

    @property
    def groups(self) -> tuple[GroupSpec, ...]:
        """Layers grouped by equal spec; token groups first, in order of first appearance.

        A draft model's layers (:func:`with_draft`) form groups of their own even where
        their spec equals a target layer's: the draft runs behind the target, so its pages
        are never published or shared (docs/architecture.md, "Speculative decoding").
        """
        by_spec: dict[tuple[bool, Spec], list[LayerCache]] = {}
        for layer in self.layers:
            by_spec.setdefault((layer.draft, layer.spec), []).append(layer)
        ordered = sorted(by_spec.items(), key=lambda kv: isinstance(kv[0][1], RecurrentStateSpec))
        return tuple(
            GroupSpec(group_id=i, spec=spec, layers=tuple(layers))
            for i, ((_, spec), layers) in enumerate(ordered)
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """Attention bytes per token over all layers (``a`` in DESIGN.md §1)."""
        return sum(
            layer.spec.bytes_per_token
            for layer in self.layers
            if not isinstance(layer.spec, RecurrentStateSpec)
        )

    @property
    def state_bytes_per_seq(self) -> int:
        """Recurrent bytes of one live sequence over all layers (``s`` in DESIGN.md §1)."""
        return sum(
            layer.spec.bytes_per_seq
            for layer in self.layers
            if isinstance(layer.spec, RecurrentStateSpec)
        )

    @property
    def num_attention_layers(self) -> int:
        return sum(not isinstance(layer.spec, RecurrentStateSpec) for layer in self.layers)

    @property
    def num_recurrent_layers(self) -> int:
        return sum(isinstance(layer.spec, RecurrentStateSpec) for layer in self.layers)

    @property
    def is_hybrid(self) -> bool:
        return self.num_attention_layers > 0 and self.num_recurrent_layers > 0


def with_draft(target: ModelSpec, draft: ModelSpec) -> ModelSpec:
    """One spec for a target model and its speculative draft model, sharing one arena.

    The draft's layers follow the target's (``layer_index`` offset by the target's layer
    count, ``draft=True``), so one CacheManager allocates both for the same token counts
    and frees them together; the draft's groups stay apart from the target's.
    """
    offset = target.num_layers
    shifted = tuple(
        LayerCache(
            layer_index=layer.layer_index + offset, name=layer.name, spec=layer.spec, draft=True
        )
        for layer in draft.layers
    )
    return ModelSpec(
        name=f"{target.name}+draft:{draft.name}",
        model_type=target.model_type,
        num_layers=offset + draft.num_layers,
        dtype=target.dtype,
        max_model_len=target.max_model_len,
        layers=target.layers + shifted,
    )

"""Typed views of the cache arena: one tensor per layer cache, no copies.

The arena is one flat ``torch.uint8`` tensor. Every group sees it as an array of its own
pages (``page_id = byte_offset // page_bytes``, see :mod:`hybridkv.core.layout`), and every
layer's tensor in a page becomes a strided view whose first dimension is the page id::

    key[page_id]   -> arena[page_id * page_bytes + offset : ...] as [block_tokens, Hkv, D]
    conv[page_id]  -> ... as [channels, kernel - 1]
    ssm[page_id]   -> ... as the state shape, e.g. GDN [Hv, Dk, Dv]

Writes through a view land in the arena, so a state copy (snapshot) is one page copy done
by the engine on bytes, and the layers never see where a page lives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from hybridkv.core.layout import ArenaLayout, TensorSlot
from hybridkv.core.spec import GroupSpec, ModelSpec, RecurrentStateSpec, SlidingWindowSpec
from hybridkv.ops.row_copy import remember_wide_rows

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


@dataclass(frozen=True, slots=True)
class AttentionView:
    """K and V pages of one attention layer.

    ``key``: [num_pages, block_tokens, num_kv_heads, head_dim];
    ``value``: [num_pages, block_tokens, num_kv_heads, value_head_dim].
    """

    group_id: int
    key: Tensor
    value: Tensor
    window_tokens: int | None  # sliding window, None for full attention

    @property
    def block_tokens(self) -> int:
        return int(self.key.shape[1])


@dataclass(frozen=True, slots=True)
class StateView:
    """State pages of one recurrent layer: ``tensors[name]`` is [num_pages, *shape]."""

    group_id: int
    tensors: dict[str, Tensor]

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]


def _slot_view(arena: Tensor, slot: TensorSlot, page_bytes: int, num_pages: int) -> Tensor:
    """[num_pages, *slot.shape] view of one tensor slot in every page of a group."""
    dtype = TORCH_DTYPES[slot.dtype]
    elem = torch.empty((), dtype=dtype).element_size()
    if page_bytes % elem or slot.offset_bytes % elem:
        raise ValueError(f"slot {slot} is not aligned to its {elem}-byte elements")
    typed = arena.view(dtype)  # [total_bytes // elem]
    inner = [math.prod(slot.shape[i + 1 :]) for i in range(len(slot.shape))]
    return torch.as_strided(
        typed,
        size=(num_pages, *slot.shape),
        stride=(page_bytes // elem, *inner),
        storage_offset=typed.storage_offset() + slot.offset_bytes // elem,
    )


class CacheViews:
    """Every layer cache of a model as typed page views over one arena.

    Look up ``views.attn(layer_index)``, ``views.state(layer_index)`` or
    ``views[(layer_index, "attn" | "state")]``.
    """

    def __init__(self, spec: ModelSpec, layout: ArenaLayout, arena: Tensor) -> None:
        if arena.dtype != torch.uint8 or arena.dim() != 1:
            raise ValueError("the arena must be a flat torch.uint8 tensor")
        if arena.numel() < layout.total_bytes:
            raise ValueError(f"arena has {arena.numel()} bytes, layout needs {layout.total_bytes}")
        self.arena = arena
        self.layout = layout
        self._views: dict[tuple[int, str], AttentionView | StateView] = {}
        for group in spec.groups:
            for key, view in _group_views(group, layout, arena).items():
                self._views[key] = view

    @classmethod
    def allocate(
        cls, spec: ModelSpec, layout: ArenaLayout, device: torch.device | str = "cpu"
    ) -> CacheViews:
        """A fresh arena of ``layout.total_bytes`` (uninitialised, like real engine memory)."""
        arena = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
        return cls(spec, layout, arena)

    def renumbered(self, first_layer: int) -> CacheViews:
        """The views of layers ``first_layer``, ``first_layer + 1``, ... as layers 0, 1, ...

        A speculative draft model's layers sit after the target's in the one arena
        (:func:`hybridkv.core.spec.with_draft`); the draft model looks them up by its own
        layer indices.
        """
        views = CacheViews.__new__(CacheViews)
        views.arena, views.layout = self.arena, self.layout
        views._views = {
            (index - first_layer, name): view
            for (index, name), view in self._views.items()
            if index >= first_layer
        }
        return views

    def __getitem__(self, key: tuple[int, str]) -> AttentionView | StateView:
        return self._views[key]

    def __contains__(self, key: tuple[int, str]) -> bool:
        return key in self._views

    def attn(self, layer_index: int) -> AttentionView:
        view = self._views[(layer_index, "attn")]
        assert isinstance(view, AttentionView)
        return view

    def state(self, layer_index: int) -> StateView:
        view = self._views[(layer_index, "state")]
        assert isinstance(view, StateView)
        return view


def _group_views(
    group: GroupSpec, layout: ArenaLayout, arena: Tensor
) -> dict[tuple[int, str], AttentionView | StateView]:
    page = layout.pages[group.group_id]
    num_pages = layout.num_pages(group.group_id)
    views: dict[tuple[int, str], AttentionView | StateView] = {}
    for layer in group.layers:
        slots = [s for s in page.slots if s.layer_index == layer.layer_index]
        tensors = {s.name: _slot_view(arena, s, page.page_bytes, num_pages) for s in slots}
        for tensor in tensors.values():
            remember_wide_rows(tensor)
        if isinstance(layer.spec, RecurrentStateSpec):
            views[(layer.layer_index, layer.name)] = StateView(group.group_id, tensors)
        else:
            window = layer.spec.window_tokens if isinstance(layer.spec, SlidingWindowSpec) else None
            views[(layer.layer_index, layer.name)] = AttentionView(
                group.group_id, tensors["key"], tensors["value"], window
            )
    return views

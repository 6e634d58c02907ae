"""CacheViews: strided views of one arena, no copies, page ids by the layout's rule."""

from __future__ import annotations

import pytest
import torch

from hybridkv.core.layout import build_layout
from hybridkv.core.model_config import model_spec_from_config
from hybridkv.forward.views import AttentionView, CacheViews, StateView

CONFIG = {
    "model_type": "qwen3_5_text",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 12,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
}


@pytest.fixture(params=["float32", "bfloat16"])
def setup(request: pytest.FixtureRequest):
    dtype = request.param
    spec = model_spec_from_config(CONFIG, kv_dtype=dtype, conv_dtype=dtype, ssm_dtype="float32")
    layout = build_layout(spec.groups, 16, 1 << 20)
    arena = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    return spec, layout, arena, CacheViews(spec, layout, arena)


def byte_offset(view: torch.Tensor, arena: torch.Tensor, index: tuple[int, ...]) -> int:
    """Arena byte offset of one element of a view."""
    elem = view[index]
    return elem.data_ptr() - arena.data_ptr()


def test_every_layer_cache_has_a_view(setup) -> None:
    spec, _, _, views = setup
    for layer in spec.layers:
        view = views[(layer.layer_index, layer.name)]
        kind = StateView if layer.name == "state" else AttentionView
        assert isinstance(view, kind)
    assert (0, "attn") not in views and (1, "attn") in views
    with pytest.raises(KeyError):
        views.attn(0)


def test_views_point_into_the_arena_at_the_layout_offsets(setup) -> None:
    spec, layout, arena, views = setup
    for group in spec.groups:
        page = layout.pages[group.group_id]
        for slot in page.slots:
            layer_view = views[(slot.layer_index, "state" if group.is_recurrent else "attn")]
            tensor = (
                layer_view[slot.name]
                if isinstance(layer_view, StateView)
                else getattr(layer_view, slot.name)
            )
            assert layer_view.group_id == group.group_id
            assert tuple(tensor.shape) == (layout.num_pages(group.group_id), *slot.shape)
            last = layout.num_pages(group.group_id) - 1
            for page_id in (0, 3, last):
                expected = page_id * page.page_bytes + slot.offset_bytes
                assert byte_offset(tensor, arena, (page_id,)) == expected


def test_writes_through_a_view_land_in_the_arena(setup) -> None:
    _, layout, arena, views = setup
    attn = views.attn(3)
    attn.key[5, 2, 1, 7] = 1.5
    page = layout.pages[attn.group_id]
    slot = page.slot(3, "key")
    elem = attn.key.element_size()
    start = 5 * page.page_bytes + slot.offset_bytes + ((2 * 2 + 1) * 24 + 7) * elem
    value = arena[start : start + elem].view(attn.key.dtype)
    assert float(value) == 1.5
    ssm = views.state(2)["ssm"]
    ssm[1].fill_(2.0)
    assert ssm.dtype == torch.float32 and float(views.state(2)["ssm"][1].sum()) == 2.0 * 4 * 16 * 12
    assert int(views.state(0)["ssm"][1].abs().sum()) == 0  # layer 0's slot is untouched


def test_arena_must_be_flat_uint8_and_big_enough(setup) -> None:
    spec, layout, arena, _ = setup
    with pytest.raises(ValueError):
        CacheViews(spec, layout, arena[:-16])
    with pytest.raises(ValueError):
        CacheViews(spec, layout, arena.view(torch.float32))

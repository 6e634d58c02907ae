"""Pre-packed oneDNN linears: the same products as ``F.linear``, packed only where safe.

bf16 products are bit-identical; fp32 ones agree to rounding (oneDNN and the BLAS sum in
other orders) and, packed, do not depend on how many rows share the call.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.layers.packed_linear import (
    PackedLinear,
    can_pack,
    keep_plain,
    pack_linears,
    packed_grouped_linear,
    packed_linear,
)

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)
# oneDNN packs bf16 only on a CPU with AVX-512 BW/VL/DQ or AVX-NE-CONVERT
needs_bf16_packing = pytest.mark.skipif(
    not can_pack(torch.bfloat16), reason="oneDNN cannot pack bf16 on this CPU (AVX2 alone)"
)
BF16_WHERE_PACKED = pytest.param(torch.bfloat16, marks=needs_bf16_packing)


def packed(linear: nn.Linear) -> PackedLinear:
    module = PackedLinear.from_linear(linear)
    assert module is not None
    return module


@needs_bf16_packing
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8, 64, 130])
def test_bf16_products_are_bit_identical(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(packed(linear)(x), linear(x))


@pytest.mark.parametrize("rows", [1, 3, 8, 64, 130])
def test_fp32_products_agree_to_rounding(rows: int) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(packed(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, BF16_WHERE_PACKED])
def test_a_row_gets_the_same_product_in_any_batch(dtype: torch.dtype) -> None:
    """Whatever the number of rows in the call, so a request's logits do not depend on
    what else shares its step (the cache-on == cache-off tests rely on exact tokens)."""
    torch.manual_seed(0)
    module = packed(nn.Linear(256, 512, bias=False).to(dtype))
    x = torch.randn(200, 256, dtype=dtype)
    with torch.inference_mode():
        full = module(x)
        for rows in (1, 2, 3, 5, 17, 64):
            assert torch.equal(module(x[:rows]), full[:rows]), rows


@needs_bf16_packing
def test_strided_and_batched_inputs() -> None:
    torch.manual_seed(1)
    linear = nn.Linear(64, 32).to(torch.bfloat16)
    module = packed(linear)
    wide = torch.randn(5, 128, dtype=torch.bfloat16)
    batched = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(module(wide[:, ::2]), linear(wide[:, ::2]))
        assert torch.equal(module(batched), linear(batched))


class Tiny(nn.Module):
    """Every case pack_linears must tell apart."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 64)
        self.big = nn.Linear(64, 64)
        self.small = nn.Linear(64, 2)
        self.read_by_weight = keep_plain(nn.Linear(64, 64))
        self.shared = nn.Linear(64, 64, bias=False)
        self.block_a = nn.Sequential(self.shared)
        self.block_b = nn.Sequential(self.shared)
        self.head = nn.Linear(64, 50, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = self.big(h) + F.linear(h, self.read_by_weight.weight)
        h = self.block_b(self.block_a(h))
        return self.head(h) + self.small(h).sum(-1, keepdim=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_linears_packs_what_nothing_else_reads(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    model = Tiny().to(dtype).eval()
    ids = torch.randint(0, 50, (7,))
    with torch.inference_mode():
        before = model(ids)
    if not can_pack(dtype):  # bf16 on a CPU with AVX2 alone: everything stays plain
        assert pack_linears(model, min_elements=1000) == 0
        assert all(type(m) is not PackedLinear for m in model.modules())
        with torch.inference_mode():
            assert torch.equal(model(ids), before)
        return
    assert pack_linears(model, min_elements=1000) == 2  # big, shared (once)
    assert isinstance(model.big, PackedLinear)
    assert isinstance(model.shared, PackedLinear)
    assert model.block_a[0] is model.block_b[0] is model.shared  # one packed module, shared
    assert type(model.small) is nn.Linear  # 128 elements: below min_elements
    assert type(model.read_by_weight) is nn.Linear  # keep_plain
    assert type(model.head) is nn.Linear and model.head.weight is model.embed.weight  # tied
    with torch.inference_mode():
        after = model(ids)
    if dtype == torch.bfloat16:
        assert torch.equal(after, before)
    else:
        torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, BF16_WHERE_PACKED])
def test_packed_weights_replace_the_plain_ones(dtype: torch.dtype) -> None:
    """No second copy: the plain weight is gone from the model, the packed one counted."""
    size = 1024  # packed in either dtype (thresholds)
    model = nn.Sequential(nn.Linear(size, size, bias=False)).to(dtype)
    plain = model[0].weight
    assert pack_linears(model) == 1
    params = list(model.parameters())
    assert len(params) == 1 and params[0] is not plain and params[0].numel() == size * size


def test_thresholds_per_dtype() -> None:
    """512 x 512 is packed in bf16 but not in fp32, where a one-row product packed costs
    more than plain; 1024 x 1024 is packed in both; fp16 never (oneDNN needs CPU support
    this project cannot assume), nor bf16 on a CPU where oneDNN cannot pack it."""
    bf16 = (PackedLinear, PackedLinear) if can_pack(torch.bfloat16) else (nn.Linear, nn.Linear)
    for dtype, packed_types in [
        (torch.bfloat16, bf16),
        (torch.float32, (nn.Linear, PackedLinear)),
        (torch.float16, (nn.Linear, nn.Linear)),
    ]:
        model = nn.Sequential(nn.Linear(512, 512), nn.Linear(1024, 1024)).to(dtype)
        pack_linears(model)
        assert tuple(type(m) for m in model) == packed_types, dtype


@pytest.mark.parametrize("dtype", [torch.float32, BF16_WHERE_PACKED])
def test_the_ops_by_handle_give_the_modules_products(dtype: torch.dtype) -> None:
    """What a compiled graph calls in place of packed modules (their weights named by
    handle): one linear, and groups of sorted rows each times its own weight, an empty
    group among them and no rows at all; the modules' own bits."""
    torch.manual_seed(0)
    modules = [packed(nn.Linear(64, 96, bias=i == 1).to(dtype)) for i in range(3)]
    x = torch.randn(7, 64, dtype=dtype)
    handles = torch.stack([m.handle for m in modules])
    with torch.inference_mode():
        for m in modules:
            assert torch.equal(packed_linear(x, m.handle, m.bias, 96), m(x))
        # groups: rows 0-2, none (the one module with a bias: grouped products have none),
        # rows 3-6
        got = packed_grouped_linear(x, torch.tensor([3, 3, 7]), handles, 96)
        assert torch.equal(got, torch.cat([modules[0](x[:3]), modules[2](x[3:])]))
        empty = packed_grouped_linear(x[:0], torch.tensor([0, 0, 0]), handles, 96)
        assert empty.shape == (0, 96)


def test_a_copy_has_a_handle_of_its_own() -> None:
    """A deep copy (a copied model) names its own weight: the graphs of the copy call it,
    not the original's, and still can once the original is gone; a shallow copy too, and
    both keep the module's mode."""
    torch.manual_seed(0)
    module = packed(nn.Linear(64, 96)).eval()
    assert int(copy.copy(module).handle) != int(module.handle)
    twin = copy.deepcopy(module)
    assert int(twin.handle) != int(module.handle) and not twin.training
    x = torch.randn(5, 64)
    with torch.inference_mode():
        want = module(x)
        del module
        gc.collect()
        assert torch.equal(packed_linear(x, twin.handle, twin.bias, 96), want)
        assert torch.equal(twin(x), want)


def test_an_op_naming_a_freed_or_other_weight_says_so() -> None:
    """A handle whose module is gone, or a width other than the graph was compiled for (a
    package of another model), is a clear error, never a product past the rows."""
    module = packed(nn.Linear(64, 96))
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="96 outputs, the graph expects 128"):
        packed_linear(x, module.handle, None, 128)
    with pytest.raises(RuntimeError, match="96 outputs"):
        packed_grouped_linear(x, torch.tensor([3]), module.handle[None], 128)
    handle = module.handle.clone()
    del module
    gc.collect()
    with pytest.raises(RuntimeError, match="no longer exists"):
        packed_linear(x, handle, None, 96)

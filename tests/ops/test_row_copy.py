"""Row gathers/scatters as 16-byte words (ops/row_copy.py) and the paged-attention slot gather.

Each fast path must move exactly the bytes of the plain op (NaN payloads included) on the
page-strided views the engine uses (a layer's tensor in every page of a byte arena), and
fall back to the plain op wherever rows are not whole 16-byte words.
"""

from __future__ import annotations

import pytest
import torch

from hybridkv.ops.paged_attention.batched import _gather, _row_view
from hybridkv.ops.paged_attention.plan import KeyGather
from hybridkv.ops.row_copy import index_copy_rows, index_select_rows, select_rows, wide_rows

NUM_PAGES = 9


def page_view(
    shape: tuple[int, ...], dtype: torch.dtype, page_bytes: int, offset: int
) -> torch.Tensor:
    """[NUM_PAGES, *shape] view of one slot at ``offset`` bytes in pages of ``page_bytes``
    of a random byte arena (NaNs and all), as hybridkv.forward.views lays them out."""
    gen = torch.Generator().manual_seed(page_bytes + offset)
    arena = torch.randint(0, 256, (NUM_PAGES * page_bytes,), dtype=torch.uint8, generator=gen)
    typed = arena.view(dtype)
    elem = typed.element_size()
    inner = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        inner[i] = inner[i + 1] * shape[i + 1]
    return typed.as_strided(
        (NUM_PAGES, *shape), (page_bytes // elem, *inner), typed.storage_offset() + offset // elem
    )


def bits(x: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so that NaN payloads compare too."""
    return x.contiguous().view(torch.uint8)


CASES = [  # (row shape, dtype, page bytes, slot offset, takes the 16-byte path)
    ((8, 4, 4), torch.bfloat16, 1024, 256, True),  # GDN-like state, bf16
    ((8, 4, 4), torch.float32, 2048, 512, True),
    ((6, 3), torch.float32, 256, 16, False),  # conv-like [C, K-1]: 72-byte rows
    ((4, 4), torch.float32, 200, 8, False),  # page stride not a multiple of 16 bytes
]


@pytest.mark.parametrize(("shape", "dtype", "page_bytes", "offset", "wide"), CASES)
def test_index_copy_rows_moves_the_bytes_of_index_copy(
    shape: tuple[int, ...], dtype: torch.dtype, page_bytes: int, offset: int, wide: bool
) -> None:
    view = page_view(shape, dtype, page_bytes, offset)
    assert (wide_rows(view) is not None) is wide
    pages = torch.tensor([7, 2, 5])
    src = page_view(shape, dtype, page_bytes, offset + 64)[:3].contiguous()
    expected = view.clone().index_copy_(0, pages, src)
    index_copy_rows(view, pages, src)
    assert torch.equal(bits(view), bits(expected))


@pytest.mark.parametrize(("shape", "dtype", "page_bytes", "offset", "wide"), CASES)
def test_index_select_rows_moves_the_bytes_of_index_select(
    shape: tuple[int, ...], dtype: torch.dtype, page_bytes: int, offset: int, wide: bool
) -> None:
    view = page_view(shape, dtype, page_bytes, offset)
    pages = torch.tensor([3, 0, 8, 3])
    out = torch.empty(4, *shape, dtype=dtype)
    index_select_rows(view, pages, out)
    assert torch.equal(bits(out), bits(view.index_select(0, pages)))


@pytest.mark.parametrize(("shape", "dtype", "page_bytes", "offset", "wide"), CASES)
def test_select_rows_moves_the_bytes_of_index_select(
    shape: tuple[int, ...], dtype: torch.dtype, page_bytes: int, offset: int, wide: bool
) -> None:
    """The allocating form (MoE's sort and combine): the plain op's bytes and shape."""
    view = page_view(shape, dtype, page_bytes, offset)
    pages = torch.tensor([3, 0, 8, 3, 3])
    got = select_rows(view, pages)
    assert got.shape == (5, *shape) and got.dtype == dtype
    assert torch.equal(bits(got), bits(view.index_select(0, pages)))


def test_select_rows_keeps_autograd() -> None:
    src = torch.randn(4, 8, requires_grad=True)
    select_rows(src * 3.0, torch.tensor([1, 1, 2])).sum().backward()
    assert src.grad is not None
    assert torch.equal(src.grad, torch.tensor([0.0, 6.0, 3.0, 0.0])[:, None].expand(4, 8))


def test_index_copy_rows_on_an_overlapping_source_takes_the_plain_op() -> None:
    view = page_view((8, 4, 4), torch.bfloat16, 1024, 0)
    expected = view.clone()
    expected.index_copy_(0, torch.tensor([1]), expected[4:5].clone())
    index_copy_rows(view, torch.tensor([1]), view[4:5])
    assert torch.equal(bits(view), bits(expected))


@pytest.mark.parametrize(
    ("page_bytes", "dtype", "fast"),
    [(4096, torch.bfloat16, True), (4096, torch.float32, True), (4100, torch.float32, False)],
)
def test_attention_gather_by_slot_rows_equals_advanced_indexing(
    page_bytes: int, dtype: torch.dtype, fast: bool
) -> None:
    """K/V pages [P, block, Hkv, D] inside bigger pages: the slot-row gather reads the same
    slots (page-strided as in the engine, NaN bytes in the arena) as cache[pages, slots]."""
    cache = page_view((4, 2, 8), dtype, page_bytes, 128)
    seen = _row_view((cache,), head_major=False)
    assert (seen is not None) is fast
    assert seen is None or seen[0].dtype == torch.complex128  # rows of 16-byte words
    gen = torch.Generator().manual_seed(3)
    pages = torch.randint(0, NUM_PAGES, (3, 2), generator=gen)
    valid = torch.rand(3, 7, generator=gen) < 0.7
    first = torch.zeros(3, 1, dtype=torch.int64)
    keys = KeyGather(pages, valid | (torch.arange(7) == 0), first, 4, None)
    got = _gather(cache, keys, dtype)
    page, slot = keys.pages_slots()
    assert torch.equal(bits(got), bits(cache[page, slot].transpose(1, 2)))


def test_tensors_autograd_tracks_take_the_plain_ops_and_keep_their_gradients() -> None:
    """Regression: the demo model trains through these ops (tests/demo); the 16-byte views
    and ``index_select(out=...)`` cut the graph, so its gradients no longer matched
    transformers'. With autograd recording, the plain ops run and gradients flow."""
    src = torch.randn(4, 8, requires_grad=True)
    dst = torch.zeros(6, 8)
    index = torch.tensor([5, 0, 3, 1])
    index_copy_rows(dst, index, src * 2.0)
    dst.sum().backward()
    assert src.grad is not None and torch.equal(src.grad, torch.full((4, 8), 2.0))

    cache = torch.randn(NUM_PAGES, 4, 2, 8, requires_grad=True)
    keys = KeyGather(
        torch.tensor([[1, 3]]),
        torch.tensor([[1, 0, 1, 1, 1, 1, 0]]).bool(),
        torch.zeros(1, 1, dtype=torch.int64),
        4,
        None,
    )
    got = _gather(cache * 1.0, keys, torch.float32)
    got.sum().backward()
    assert cache.grad is not None
    expected = torch.zeros_like(cache)
    expected[1, 0] = 3.0  # column 0, and columns 1 and 6 re-reading it
    expected[1, 2:4] = 1.0
    expected[3, 0:2] = 1.0
    assert torch.equal(cache.grad, expected)


def test_remembered_page_views_copy_the_same_bytes_and_are_forgotten() -> None:
    """A remembered view (a layer's page view) reuses its wide view: the same bytes move
    as with the plain ops, both ways; freeing the view forgets it."""
    from hybridkv.ops import row_copy

    view = page_view((4, 12), torch.float32, 256, 32)
    row_copy.remember_wide_rows(view)
    assert (view,) in row_copy._KNOWN_WIDE
    index = torch.tensor([6, 1, 3])
    out = torch.empty(3, 4, 12)
    index_select_rows(view, index, out)
    assert torch.equal(bits(out), bits(view.index_select(0, index)))
    src = torch.randn(3, 4, 12)
    want = view.clone().index_copy_(0, index, src)
    index_copy_rows(view, index, src)
    assert torch.equal(bits(view), bits(want))
    remembered = len(row_copy._KNOWN_WIDE)
    del view
    assert len(row_copy._KNOWN_WIDE) == remembered - 1

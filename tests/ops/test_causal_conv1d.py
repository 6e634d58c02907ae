"""Causal conv1d with carried state: chunks resume exactly, one-step update, paged varlen."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ops_checks import RAGGED_TOKENS, check_varlen_batch
from torch import Tensor

from hybridkv.ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update, causal_conv1d_varlen
from hybridkv.ops.causal_conv1d import paged as conv_module
from hybridkv.ops.paged_state import StateBatch, StateCaptures

C, K = 10, 4


def params(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(C, K, generator=gen), torch.randn(C, generator=gen)


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Uncached reference: conv1d(padding=K-1) truncated, then silu. x [n, C]."""
    out = F.conv1d(x.T[None], weight[:, None], bias, padding=K - 1, groups=C)[0, :, : x.shape[0]]
    return F.silu(out).T


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("cuts", [[1], [2, 3], [7], [1, 1, 1, 1, 5]], ids=str)
def test_chunks_with_carried_state_equal_one_pass(cuts: list[int], bias: bool) -> None:
    weight, b = params()
    b = b if bias else None
    x = torch.randn(20, C)
    ref = dense(x, weight, b)
    state, pos, outs = None, 0, []
    for size in [*cuts, 20]:
        if pos >= 20:
            break
        out, state = causal_conv1d_fn(x[pos : pos + size], weight, b, state, "silu")
        outs.append(out)
        pos += size
    torch.testing.assert_close(torch.cat(outs), ref)
    torch.testing.assert_close(state, x[-(K - 1) :].T)  # the last K-1 raw inputs


def test_short_sequence_state_is_left_zero_padded() -> None:
    weight, b = params()
    x = torch.randn(2, C)
    _, state = causal_conv1d_fn(x, weight, b, None, "silu")
    torch.testing.assert_close(state, torch.cat([torch.zeros(C, 1), x.T], dim=1))


def test_update_equals_one_token_chunk() -> None:
    weight, b = params()
    state = torch.randn(3, C, K - 1)
    x = torch.randn(3, C)
    expected = [causal_conv1d_fn(x[i : i + 1], weight, b, state[i], "silu") for i in range(3)]
    out = causal_conv1d_update(x, state, weight, b, "silu")  # state updated in place
    for i, (o, s) in enumerate(expected):
        torch.testing.assert_close(out[i], o[0])
        torch.testing.assert_close(state[i], s)


def test_paged_varlen_reads_and_writes_pages() -> None:
    weight, b = params()
    fresh = [False, True, True, False]  # lengths 1, 6, 1, 2
    starts = [0, 1, 7, 8, 10]
    x = torch.randn(10, C)
    pages = torch.full((6, C, K - 1), float("nan"))
    state_pages = torch.tensor([4, 0, 5, 2])
    initial = torch.randn(4, C, K - 1)
    for r, page in enumerate(state_pages.tolist()):
        if not fresh[r]:
            pages[page] = initial[r]
    states = StateBatch(starts, state_pages, [not f for f in fresh])
    out = causal_conv1d_varlen(x, pages, states, weight, b, "silu")
    for r, page in enumerate(state_pages.tolist()):
        lo, hi = starts[r], starts[r + 1]
        o, s = causal_conv1d_fn(x[lo:hi], weight, b, None if fresh[r] else initial[r], "silu")
        torch.testing.assert_close(out[lo:hi], o)
        torch.testing.assert_close(pages[page], s)
    assert torch.isnan(pages[1]).all() and torch.isnan(pages[3]).all()


@pytest.mark.parametrize("block_tokens", [None, 40], ids=["one_block", "blocks"])
@pytest.mark.parametrize("with_captures", [False, True], ids=["no_capture", "captures"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("page_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_varlen_equals_each_request_alone(
    page_dtype: torch.dtype,
    bias: bool,
    with_captures: bool,
    block_tokens: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ragged prefills and decodes in one pass == the chunk reference per request; a
    captured state == the last K-1 inputs up to its row (initial state included)."""
    if block_tokens is not None:  # many small blocks of requests
        monkeypatch.setattr(conv_module, "BLOCK_TOKENS", block_tokens)
    weight, b = params(1)
    b = b if bias else None
    x = torch.randn(RAGGED_TOKENS, C, generator=torch.Generator().manual_seed(2))

    def run_varlen(view: Tensor, states: StateBatch) -> Tensor:
        return causal_conv1d_varlen(x, view, states, weight, b, "silu")

    def run_alone(part: slice, init: Tensor | None) -> tuple[Tensor, Tensor]:
        return causal_conv1d_fn(x[part], weight, b, init, "silu")

    check_varlen_batch((C, K - 1), page_dtype, run_varlen, run_alone, with_captures)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("page_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_step_equals_block_path_and_reference(page_dtype: torch.dtype, bias: bool) -> None:
    """A step where every request decodes takes the one-token path: its outputs, live pages
    and final-row captures equal the block path's bit for bit (the same requests run with
    a multi-token request beside them) and the reference; fresh pages are NaN-poisoned and
    pages nobody holds stay untouched. Channels are a multiple of 16 so that both paths'
    elementwise kernels run fully vectorised (a scalar tail may round a product apart from
    its fused vector lane)."""
    channels = 32
    gen = torch.Generator().manual_seed(3)
    weight, b = torch.randn(channels, K, generator=gen), torch.randn(channels, generator=gen)
    b = b if bias else None
    carried = [True, False, True, True, False]
    live, capture_pages, unused = [6, 0, 3, 8, 1], [2, 9], [4, 5, 7]
    x = torch.randn(len(carried) + 3, channels, generator=gen)  # the decodes' rows, then 3 more

    def run(with_prefill: bool) -> tuple[Tensor, Tensor]:
        view = torch.full((11, channels, K - 1), float("nan"), dtype=page_dtype)
        torch.manual_seed(5)
        for r, page in enumerate(live):
            if carried[r]:
                view[page] = torch.randn(channels, K - 1).to(page_dtype)
        lens = [1] * len(carried) + ([3] if with_prefill else [])
        pages = live + ([10] if with_prefill else [])
        starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
        captures = StateCaptures(torch.tensor([0, 3]), torch.tensor(capture_pages))
        states = StateBatch(starts, torch.tensor(pages), [*carried, False][: len(lens)], captures)
        out = causal_conv1d_varlen(x[: starts[-1]], view, states, weight, b, "silu")
        return out[: len(carried)], view

    fast, fast_view = run(with_prefill=False)
    general, general_view = run(with_prefill=True)
    assert torch.equal(fast, general)
    for page in live + capture_pages:
        assert torch.equal(fast_view[page], general_view[page])
    for page in unused:
        assert torch.isnan(fast_view[page]).all()
    torch.manual_seed(5)
    initial = {
        r: torch.randn(channels, K - 1).to(page_dtype) for r in range(len(carried)) if carried[r]
    }
    for r, page in enumerate(live):
        init = initial[r].float() if carried[r] else None
        want, state = causal_conv1d_fn(x[r : r + 1], weight, b, init, "silu")
        torch.testing.assert_close(fast[r], want[0])
        torch.testing.assert_close(fast_view[page].float(), state.to(page_dtype).float())
    for row, page in zip([0, 3], capture_pages, strict=True):
        assert torch.equal(fast_view[page], fast_view[live[row]])


def test_empty_request_beside_a_decode_takes_the_block_path() -> None:
    """A step with as many requests as rows is not all decodes when one request has no rows:
    [0, 1, 2] rows must run the block path (the one-token path once took it and failed)."""
    channels = 32
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(channels, K, generator=gen)
    x = torch.randn(3, channels, generator=gen)
    view = torch.randn(5, channels, K - 1, generator=gen)
    before = view.clone()
    states = StateBatch([0, 0, 1, 3], torch.tensor([0, 2, 4]), [True, True, True])
    out = causal_conv1d_varlen(x, view, states, weight, None, "silu")
    for rows, page in ((slice(0, 1), 2), (slice(1, 3), 4)):
        want, state = causal_conv1d_fn(x[rows], weight, None, before[page], "silu")
        torch.testing.assert_close(out[rows], want)
        torch.testing.assert_close(view[page], state)
    assert torch.equal(view[0], before[0])

"""Causal conv1d with carried state: chunks resume exactly, one-step update, paged varlen."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ops_checks import RAGGED_TOKENS, check_varlen_batch
from torch import Tensor

from hybridkv.ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update, causal_conv1d_varlen
from hybridkv.ops.causal_conv1d import paged as conv_module
from hybridkv.ops.paged_state import StateBatch

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

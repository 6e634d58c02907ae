"""Gated delta rule: chunked == recurrent, == transformers' torch path, paged == per request."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from ops_checks import RAGGED_TOKENS, check_varlen_batch
from torch import Tensor

from hybridkv.ops.gated_delta_rule import (
    chunk_gated_delta_rule,
    chunk_operands,
    gated_delta_rule_varlen,
    recurrent_gated_delta_rule,
)
from hybridkv.ops.gated_delta_rule import paged as gdn_module
from hybridkv.ops.paged_state import StateBatch

hf_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


def make_inputs(n: int, hk: int = 2, hv: int = 4, dk: int = 16, dv: int = 12, batch: int = 1):
    gen = torch.Generator().manual_seed(n * 31 + hv)
    q = torch.randn(batch, n, hk, dk, generator=gen)
    k = torch.randn(batch, n, hk, dk, generator=gen)
    v = torch.randn(batch, n, hv, dv, generator=gen)
    g = -torch.rand(batch, n, hv, generator=gen) * 2  # log decay <= 0
    beta = torch.rand(batch, n, hv, generator=gen)
    state = torch.randn(batch, hv, dk, dv, generator=gen) * 0.5
    return q, k, v, g, beta, state


@pytest.mark.parametrize("n", [1, 5, 64, 70, 130])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunked_equals_recurrent_with_initial_state(n: int, chunk_size: int) -> None:
    q, k, v, g, beta, state = make_inputs(n)
    o1, s1 = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=chunk_size)
    o2, s2 = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(o1, o2, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s1, s2, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("n", [3, 70])
def test_matches_transformers(n: int) -> None:
    q, k, v, g, beta, state = make_inputs(n, batch=2)
    for ours, theirs in [
        (chunk_gated_delta_rule, hf_next.torch_chunk_gated_delta_rule),
        (recurrent_gated_delta_rule, hf_next.torch_recurrent_gated_delta_rule),
    ]:
        o1, s1 = ours(q, k, v, g, beta, state)
        o2, s2 = theirs(
            q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        torch.testing.assert_close(o1, o2, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s1, s2, atol=1e-5, rtol=1e-5)


def test_split_sequence_resumes_from_state() -> None:
    q, k, v, g, beta, _ = make_inputs(50)
    whole, s_whole = chunk_gated_delta_rule(q, k, v, g, beta)
    a, s_a = chunk_gated_delta_rule(q[:, :17], k[:, :17], v[:, :17], g[:, :17], beta[:, :17])
    b, s_b = chunk_gated_delta_rule(q[:, 17:], k[:, 17:], v[:, 17:], g[:, 17:], beta[:, 17:], s_a)
    torch.testing.assert_close(torch.cat([a, b], dim=1), whole, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s_b, s_whole, atol=2e-5, rtol=1e-4)


def test_paged_varlen_equals_each_request_alone() -> None:
    """Decodes and chunks mixed; fresh requests ignore the NaN garbage in their page."""
    lens, fresh = [1, 9, 1, 4], [False, True, True, False]
    q, k, v, g, beta, _ = (t[0] for t in make_inputs(sum(lens)))
    pages = torch.full((8, 4, 16, 12), float("nan"))
    state_pages = torch.tensor([6, 1, 3, 0])
    initial = torch.randn(4, 4, 16, 12)
    for r, page in enumerate(state_pages.tolist()):
        if not fresh[r]:
            pages[page] = initial[r]
    starts = [0, 1, 10, 11, 15]
    states = StateBatch(starts, state_pages, [not f for f in fresh])
    out = gated_delta_rule_varlen(q, k, v, g, beta, pages, states)
    for r, page in enumerate(state_pages.tolist()):
        lo, hi = starts[r], starts[r + 1]
        init = None if fresh[r] else initial[r][None]
        o, s = recurrent_gated_delta_rule(
            q[None, lo:hi], k[None, lo:hi], v[None, lo:hi], g[None, lo:hi], beta[None, lo:hi], init
        )
        torch.testing.assert_close(out[lo:hi], o[0], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(pages[page], s[0], atol=2e-5, rtol=1e-4)
    assert torch.isnan(pages[2]).all()  # pages of no request are untouched


@pytest.mark.parametrize("block_tokens", [None, 40], ids=["one_block", "blocks"])
@pytest.mark.parametrize("with_captures", [False, True], ids=["no_capture", "captures"])
@pytest.mark.parametrize("chunk_size", [12, 16, 64], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("page_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_varlen_equals_each_request_alone(
    page_dtype: torch.dtype,
    chunk_size: int,
    with_captures: bool,
    block_tokens: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ragged prefills and decodes in one call == the chunked reference per request; every
    captured state == the final state of the reference run up to its row."""
    if block_tokens is not None:  # many small blocks of requests
        monkeypatch.setattr(gdn_module, "BLOCK_TOKENS", block_tokens)
    q, k, v, g, beta, _ = (t[0] for t in make_inputs(RAGGED_TOKENS))

    def run_varlen(view: Tensor, states: StateBatch) -> Tensor:
        return gated_delta_rule_varlen(q, k, v, g, beta, view, states, chunk_size)

    run_alone = reference_per_request(chunk_gated_delta_rule, q, k, v, g, beta)
    check_varlen_batch((4, 16, 12), page_dtype, run_varlen, run_alone, with_captures)


def reference_per_request(
    reference: Callable[..., tuple[Tensor, Tensor]], *rows: Tensor
) -> Callable[[slice, Tensor | None], tuple[Tensor, Tensor]]:
    """``run_alone`` for check_varlen_batch: ``reference`` (chunked or recurrent form) over
    one request's rows of q, k, v, g, beta from an initial state (None: zeros)."""

    def run_alone(part: slice, init: Tensor | None) -> tuple[Tensor, Tensor]:
        o, s = reference(*(x[None, part] for x in rows), None if init is None else init[None])
        return o[0], s[0]

    return run_alone


@pytest.mark.parametrize("with_captures", [False, True], ids=["no_capture", "captures"])
@pytest.mark.parametrize("page_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_decode_only_step_equals_each_request_alone(
    page_dtype: torch.dtype, with_captures: bool
) -> None:
    """Every row a decode (the step shape that skips picking the decode rows): fresh and
    carried states, NaN-poisoned pages, captures after the one row; q, k, v strided views
    of one projection, as the layers pass them (a regression: fp32 rows are not copied)."""
    lens, carried = [1] * 7, [True, False, True, True, False, True, True]
    q, k, v, g, beta, _ = (t[0] for t in make_inputs(len(lens)))
    fused = torch.cat([t.flatten(1) for t in (q, k, v)], dim=1)  # [T, q | k | v]
    parts = fused.split([t[0].numel() for t in (q, k, v)], dim=1)
    q, k, v = (p.unflatten(1, t.shape[1:]) for p, t in zip(parts, (q, k, v), strict=True))
    assert not v.is_contiguous()

    def run_varlen(view: Tensor, states: StateBatch) -> Tensor:
        assert states.decodes is not None and states.decodes.rows.numel() == len(lens)
        return gated_delta_rule_varlen(q, k, v, g, beta, view, states)

    run_alone = reference_per_request(recurrent_gated_delta_rule, q, k, v, g, beta)
    check_varlen_batch((4, 16, 12), page_dtype, run_varlen, run_alone, with_captures, lens, carried)


@pytest.mark.parametrize("batch", [3, 24])
@pytest.mark.parametrize("n", [1, 7, 16, 17, 33, 64])
def test_unit_lower_inverse_equals_triangular_solve(n: int, batch: int) -> None:
    """The inverse built by halves (24 x 2 matrices: past SOLVE_ROWS from 17 rows on) or
    solved directly (3 x 2) times a right-hand side == the triangular solve, for sizes that
    are and are not powers of two (a step's chunks are as short as its requests)."""
    gen = torch.Generator().manual_seed(n)
    t = torch.randn(batch, 2, n, n, generator=gen).tril(-1) * 0.3 + torch.eye(n)
    rhs = torch.randn(batch, 2, n, 5, generator=gen)
    want = torch.linalg.solve_triangular(t, rhs, upper=False, unitriangular=True)
    inverse = chunk_operands.unit_lower_inverse(t)
    assert torch.equal(inverse.triu(1), torch.zeros_like(inverse))
    torch.testing.assert_close(inverse @ rhs, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(inverse @ t, torch.eye(n).expand_as(t), rtol=1e-5, atol=1e-5)


def test_captures_at_chunk_ends_copy_the_carried_states() -> None:
    """Snapshots that all fall on chunk ends (a prefill from a block boundary in chunks of
    a block) are the states the loop carries on, copied: equal to a forward up to there;
    a capture inside a chunk (row 20) takes the computed path in its step, equal too."""
    from hybridkv.ops.paged_state import StateCaptures

    q, k, v, g, beta, _ = (t[0] for t in make_inputs(40))
    starts, live = [0, 40], 0
    for rows, pages in (([15, 31], [1, 2]), ([15, 20], [1, 2])):
        view = torch.full((3, 4, 16, 12), float("nan"))
        captures = StateCaptures(torch.tensor(rows), torch.tensor(pages))
        states = StateBatch(starts, torch.tensor([live]), [False], captures)
        layout = states.chunks(16, gdn_module.BLOCK_TOKENS)[0]
        at_end = [c.at_chunk_end for c in layout.captures if c is not None]
        assert at_end == ([True, True] if rows == [15, 31] else [True, False])
        gated_delta_rule_varlen(q, k, v, g, beta, view, states, chunk_size=16)
        for row, page in zip(rows, pages, strict=True):
            picked = (x[None, : row + 1] for x in (q, k, v, g, beta))
            _, want = chunk_gated_delta_rule(*picked, None, chunk_size=16)
            torch.testing.assert_close(view[page], want[0], rtol=1e-5, atol=1e-5)

"""Helpers the op tests share: the relative error, and the paged and varlen batch checks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from hybridkv.ops.paged_state import StateBatch, StateCaptures

# Four requests in one flat batch: a carried prefill chunk, a carried decode, a fresh
# prefill and a fresh one-token prompt, on pages scattered over an 8-page view.
LENS, CARRIED, PAGES = [5, 1, 20, 1], [True, True, False, False], [3, 0, 6, 2]
STARTS = [0, *torch.tensor(LENS).cumsum(0).tolist()]  # request r: tokens STARTS[r]..STARTS[r+1]
NUM_TOKENS = STARTS[-1]
UNUSED_PAGES = [1, 4, 5, 7]

# A ragged step: prefill chunks of 1 to 200 rows around the chunk and block sizes, decodes
# among them, with and without a carried state.
RAGGED_LENS = [17, 1, 64, 2, 200, 1, 15, 65, 16, 1, 63, 3]
RAGGED_CARRIED = [True, True, False, True, False, False, True, True, False, True, True, False]
RAGGED_TOKENS = sum(RAGGED_LENS)

# tolerances (max |diff| / max |want|): fp32 math throughout, so outputs and fp32 pages
# agree to rounding; a bf16 page holds the same state rounded once (2^-8 relative)
FP32_TOL, BF16_PAGE_TOL = 1e-5, 4e-3


def rel_err(got: Tensor, want: Tensor) -> float:
    return (
        (got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-12)
    ).item()


def check_paged_batch(
    state_shape: tuple[int, ...],
    run_paged: Callable[[Tensor, Tensor, list[bool], list[int]], Tensor],
    run_alone: Callable[[slice, Tensor | None], tuple[Tensor, Tensor]],
) -> None:
    """Mixed decodes and prefill chunks, fresh and carried, on a strided page view.

    ``run_paged(view, pages, carried, starts)`` runs the batch and returns y [T, ...];
    ``run_alone(part, initial_state)`` runs one request's tokens ``part`` from
    ``initial_state`` (None: zeros) and returns (y, final state). Each request's output
    and page must match its run alone, and pages no request holds must stay untouched.
    """
    view = torch.randn(8, 2, *state_shape)[:, 1]  # [num_pages, *state], not contiguous
    before = view.clone()
    y = run_paged(view, torch.tensor(PAGES), CARRIED, STARTS)
    for r, page in enumerate(PAGES):
        part = slice(STARTS[r], STARTS[r + 1])
        want_y, want_state = run_alone(part, before[page] if CARRIED[r] else None)
        assert rel_err(y[part], want_y) <= 1e-5
        assert rel_err(view[page], want_state) <= 1e-5
    assert torch.equal(view[UNUSED_PAGES], before[UNUSED_PAGES])


def capture_positions(length: int) -> list[int]:
    """Rows of a request to capture after: its first, around 16 and 64, middle and last."""
    return sorted({p for p in (0, 14, 15, 16, 30, length // 2, 63, 64, length - 1) if p < length})


@dataclass
class RaggedStep:
    """A ragged step on a NaN-poisoned, strided page view with scrambled pages."""

    view: Tensor  # [num_pages, *state] page dtype
    pages: list[int]  # live page of each request
    captures: list[tuple[int, int, int]]  # (request, row within it, capture page)
    unused: list[int]  # pages nobody may touch
    initial: dict[int, Tensor]  # fp32 initial state of each carried request

    def batch(self, lens: list[int], carried: list[bool]) -> StateBatch:
        starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
        captures = None
        if self.captures:
            rows = torch.tensor([starts[r] + p for r, p, _ in self.captures])
            captures = StateCaptures(rows, torch.tensor([page for _, _, page in self.captures]))
        return StateBatch(starts, torch.tensor(self.pages), carried, captures)


def make_ragged_step(
    state_shape: tuple[int, ...],
    page_dtype: torch.dtype,
    lens: list[int],
    carried: list[bool],
    with_captures: bool,
    seed: int = 0,
) -> RaggedStep:
    gen = torch.Generator().manual_seed(seed)
    captures = [(r, p) for r, n in enumerate(lens) for p in capture_positions(n)]
    num_pages = len(lens) + (len(captures) if with_captures else 0) + 6
    view = torch.full((num_pages, 2, *state_shape), float("nan"), dtype=page_dtype)[:, 1]
    order = torch.randperm(num_pages, generator=gen).tolist()
    pages, order = order[: len(lens)], order[len(lens) :]
    initial = {}
    for r, page in enumerate(pages):
        if carried[r]:
            view[page] = torch.randn(state_shape, generator=gen) * 0.5
            initial[r] = view[page].float().clone()
    placed = []
    if with_captures:
        placed = [(r, p, order.pop()) for r, p in captures]
    return RaggedStep(view, pages, placed, order, initial)


def check_varlen_batch(
    state_shape: tuple[int, ...],
    page_dtype: torch.dtype,
    run_varlen: Callable[[Tensor, StateBatch], Tensor],
    run_alone: Callable[[slice, Tensor | None], tuple[Tensor, Tensor]],
    with_captures: bool = False,
    lens: list[int] = RAGGED_LENS,
    carried: list[bool] = RAGGED_CARRIED,
) -> None:
    """The varlen op on a ragged step == each request run alone by the reference.

    ``run_varlen(view, states)`` runs the step and returns y [T, ...]; ``run_alone(rows,
    initial)`` runs rows ``rows`` of one request from an fp32 state (None: zeros) and
    returns (y, final state). Checked: every output row, every final state, every captured
    state (== the final state of a run up to its row), and that no unused page is touched
    and no NaN leaks.
    """
    step = make_ragged_step(state_shape, page_dtype, lens, carried, with_captures)
    states = step.batch(lens, carried)
    y = run_varlen(step.view, states)
    assert torch.isfinite(y).all()
    state_tol = FP32_TOL if page_dtype == torch.float32 else BF16_PAGE_TOL
    starts = states.starts
    for r, page in enumerate(step.pages):
        part = slice(starts[r], starts[r + 1])
        want_y, want_state = run_alone(part, step.initial.get(r))
        assert rel_err(y[part], want_y) <= FP32_TOL, (r, rel_err(y[part], want_y))
        assert rel_err(step.view[page], want_state) <= state_tol, (r, "final state")
    for r, pos, page in step.captures:
        _, want_state = run_alone(slice(starts[r], starts[r] + pos + 1), step.initial.get(r))
        assert rel_err(step.view[page], want_state) <= state_tol, (r, pos, "capture")
    assert torch.isnan(step.view[step.unused].float()).all()

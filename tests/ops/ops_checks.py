"""Helpers the op tests share: the relative error and the paged-batch check."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# Four requests in one flat batch: a carried prefill chunk, a carried decode, a fresh
# prefill and a fresh one-token prompt, on pages scattered over an 8-page view.
LENS, CARRIED, PAGES = [5, 1, 20, 1], [True, True, False, False], [3, 0, 6, 2]
STARTS = [0, *torch.tensor(LENS).cumsum(0).tolist()]  # request r: tokens STARTS[r]..STARTS[r+1]
NUM_TOKENS = STARTS[-1]
UNUSED_PAGES = [1, 4, 5, 7]


def rel_err(got: Tensor, want: Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp(min=1e-12)).item()


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

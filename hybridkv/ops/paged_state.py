"""The varlen driver every recurrent op shares: each request of a step on its own state page.

A step's rows are request-major (request ``r`` owns rows ``starts[r]..starts[r+1]``) and
its state lives in page ``state_pages[r]`` of the layer's view. One-token requests
(decodes) run together through the op's one-step form on a gathered copy of their states;
longer chunks run one by one through its chunked form. A request without an initial state
starts from zeros (its page holds garbage and is overwritten).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# (rows [B] of the one-token requests, their states [B, *state]) -> (y, updated states)
StepFn = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
# (rows of one request, its state [*state] or None for zeros) -> (y, final state)
ScanFn = Callable[[slice, Tensor | None], tuple[Tensor, Tensor]]


def run_on_state_pages(
    out: Tensor,
    page_view: Tensor,
    state_pages: Tensor,
    has_initial_state: list[bool],
    starts: list[int],
    step: StepFn,
    scan: ScanFn,
    step_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Fill ``out`` [T, ...] request by request, reading and writing ``page_view`` in place.

    ``step`` gets the decodes' states in ``step_dtype``; every final state is cast back to
    the page's dtype.
    """
    pages = state_pages.tolist()
    single = [r for r in range(len(pages)) if starts[r + 1] - starts[r] == 1]
    if single:
        rows = torch.tensor([starts[r] for r in single], device=out.device)
        idx = torch.tensor([pages[r] for r in single], device=out.device)
        state = page_view[idx].to(step_dtype)  # [B, *state] (gathered copy)
        fresh = torch.tensor([not has_initial_state[r] for r in single], device=out.device)
        state[fresh] = 0
        out[rows], state = step(rows, state)
        page_view[idx] = state.to(page_view.dtype)
    for r, page in enumerate(pages):
        lo, hi = starts[r], starts[r + 1]
        if hi - lo < 2:
            continue
        initial = page_view[page] if has_initial_state[r] else None
        out[lo:hi], final = scan(slice(lo, hi), initial)
        page_view[page] = final.to(page_view.dtype)
    return out

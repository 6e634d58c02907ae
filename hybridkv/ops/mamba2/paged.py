"""Mamba2 SSD over a flat varlen batch, with each request's state kept in its page."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hybridkv.ops.mamba2.naive import NO_DT_LIMIT, DtLimit, ssd_chunk_scan, ssd_state_update
from hybridkv.ops.paged_state import run_on_state_pages


@dataclass(frozen=True, kw_only=True, slots=True)
class SSDParams:
    """The input-independent parameters of one Mamba2 layer's SSM."""

    A: Tensor  # [H], negative: -exp(A_log)
    D: Tensor | None  # [H] skip
    dt_bias: Tensor | None  # [H]
    chunk_size: int
    dt_limit: DtLimit = NO_DT_LIMIT
    step_dt_limit: DtLimit | None = None  # one-token steps; None: same as dt_limit


def ssd_paged(
    x: Tensor,
    dt: Tensor,
    B: Tensor,
    C: Tensor,
    params: SSDParams,
    ssm_pages: Tensor,
    state_pages: Tensor,
    has_initial_state: list[bool],
    starts: list[int],
) -> Tensor:
    """Run every request of a step, reading and writing its SSM state page in place.

    One-token requests (decodes) run together through the one-step update; longer chunks
    run one by one through the chunked scan, from their page or from zeros when
    ``has_initial_state`` is False (the page then holds garbage and is overwritten).

    Args:
        x: [T, H, P]; dt: [T, H] raw; B, C: [T, G, N]; rows request-major.
        ssm_pages: [num_pages, H, P, N] the layer's state view.
        state_pages: [R] live state page of each request; starts: R+1 row offsets.

    Returns:
        [T, H, P] in x's dtype.
    """
    kw = {"D": params.D, "dt_bias": params.dt_bias}
    step_limit = params.dt_limit if params.step_dt_limit is None else params.step_dt_limit

    def step(rows: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        y = ssd_state_update(
            state, x[rows], dt[rows], params.A, B[rows], C[rows], dt_limit=step_limit, **kw
        )
        return y, state

    def scan(rows: slice, initial: Tensor | None) -> tuple[Tensor, Tensor]:
        return ssd_chunk_scan(
            x[rows],
            dt[rows],
            params.A,
            B[rows],
            C[rows],
            chunk_size=params.chunk_size,
            dt_limit=params.dt_limit,
            initial_state=initial,
            **kw,
        )

    out = torch.empty_like(x)
    return run_on_state_pages(out, ssm_pages, state_pages, has_initial_state, starts, step, scan)

"""Mamba1 selective scan over a flat varlen batch, with each request's state in its page."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hybridkv.ops.mamba1.naive import selective_scan, selective_state_update
from hybridkv.ops.paged_state import run_on_state_pages


@dataclass(frozen=True, kw_only=True, slots=True)
class SelectiveScanParams:
    """The input-independent parameters of one Mamba1 layer's SSM."""

    A: Tensor  # [d_inner, N], negative: -exp(A_log)
    D: Tensor | None  # [d_inner] skip
    dt_bias: Tensor | None  # [d_inner], dt_proj.bias


def selective_scan_paged(
    x: Tensor,
    dt: Tensor,
    B: Tensor,
    C: Tensor,
    z: Tensor | None,
    params: SelectiveScanParams,
    ssm_pages: Tensor,
    state_pages: Tensor,
    has_initial_state: list[bool],
    starts: list[int],
) -> Tensor:
    """Run every request of a step, reading and writing its SSM state page in place.

    One-token requests (decodes) run together through the one-step update; longer chunks
    run one by one through the scan, from their page or from zeros when
    ``has_initial_state`` is False.

    Args:
        x, dt, z: [T, d_inner] (dt raw); B, C: [T, N]; rows request-major.
        ssm_pages: [num_pages, d_inner, N] the layer's state view.
        state_pages: [R] live state page of each request; starts: R+1 row offsets.

    Returns:
        [T, d_inner] in x's dtype.
    """
    kw = {"D": params.D, "dt_bias": params.dt_bias}

    def step(rows: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        zr = z[rows] if z is not None else None
        y = selective_state_update(state, x[rows], dt[rows], params.A, B[rows], C[rows], z=zr, **kw)
        return y, state

    def scan(rows: slice, initial: Tensor | None) -> tuple[Tensor, Tensor]:
        zr = z[rows] if z is not None else None
        return selective_scan(
            x[rows], dt[rows], params.A, B[rows], C[rows], z=zr, initial_state=initial, **kw
        )

    out = torch.empty_like(x)
    return run_on_state_pages(out, ssm_pages, state_pages, has_initial_state, starts, step, scan)

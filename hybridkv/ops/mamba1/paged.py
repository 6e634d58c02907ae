"""Mamba1 selective scan over a flat varlen batch, with each request's state in its page."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hybridkv.ops.mamba1.naive import selective_scan, selective_state_update


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
    out = torch.empty_like(x)
    pages = state_pages.tolist()
    single = [r for r in range(len(pages)) if starts[r + 1] - starts[r] == 1]
    if single:
        rows = torch.tensor([starts[r] for r in single], device=x.device)
        idx = torch.tensor([pages[r] for r in single], device=x.device)
        state = ssm_pages[idx].to(torch.float32)  # [B, d_inner, N] (gathered copy)
        fresh = torch.tensor([not has_initial_state[r] for r in single], device=x.device)
        state[fresh] = 0
        zr = z[rows] if z is not None else None
        out[rows] = selective_state_update(
            state, x[rows], dt[rows], params.A, B[rows], C[rows], z=zr, **kw
        )
        ssm_pages[idx] = state.to(ssm_pages.dtype)
    for r, page in enumerate(pages):
        lo, hi = starts[r], starts[r + 1]
        if hi - lo < 2:
            continue
        initial = ssm_pages[page] if has_initial_state[r] else None
        zr = z[lo:hi] if z is not None else None
        out[lo:hi], final = selective_scan(
            x[lo:hi], dt[lo:hi], params.A, B[lo:hi], C[lo:hi], z=zr, initial_state=initial, **kw
        )
        ssm_pages[page] = final.to(ssm_pages.dtype)
    return out

"""Gated delta rule over a flat varlen batch, with the state kept in its pages."""

from __future__ import annotations

import torch
from torch import Tensor

from hybridkv.ops.gated_delta_rule.naive import chunk_gated_delta_rule, recurrent_gated_delta_rule


def gated_delta_rule_paged(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    ssm_pages: Tensor,
    state_pages: Tensor,
    has_initial_state: list[bool],
    starts: list[int],
) -> Tensor:
    """Run every request of a step, reading and writing its state page in place.

    One-token requests (decodes) run together through the recurrent form; longer chunks run
    one by one through the chunked form, starting from their page (or zeros when
    ``has_initial_state`` is False).

    Args:
        q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g, beta: [T, Hv]; rows request-major.
        ssm_pages: [num_pages, Hv, Dk, Dv] the layer's state view.
        state_pages: [R] live state page of each request; starts: R+1 row offsets.

    Returns:
        [T, Hv, Dv] in v's dtype.
    """
    out = torch.empty_like(v)
    pages = state_pages.tolist()
    single = [r for r in range(len(pages)) if starts[r + 1] - starts[r] == 1]
    if single:
        rows = torch.tensor([starts[r] for r in single], device=v.device)
        idx = torch.tensor([pages[r] for r in single], device=v.device)
        state = ssm_pages[idx].to(torch.float32)  # [B, Hv, Dk, Dv] (gathered copy)
        fresh = torch.tensor([not has_initial_state[r] for r in single], device=v.device)
        state[fresh] = 0
        o, final = recurrent_gated_delta_rule(
            q[rows, None], k[rows, None], v[rows, None], g[rows, None], beta[rows, None], state
        )
        out[rows] = o[:, 0]
        ssm_pages[idx] = final.to(ssm_pages.dtype)
    for r, page in enumerate(pages):
        lo, hi = starts[r], starts[r + 1]
        if hi - lo < 2:
            continue
        initial = ssm_pages[page][None] if has_initial_state[r] else None
        o, final = chunk_gated_delta_rule(
            q[None, lo:hi],
            k[None, lo:hi],
            v[None, lo:hi],
            g[None, lo:hi],
            beta[None, lo:hi],
            initial,
        )
        out[lo:hi] = o[0]
        ssm_pages[page] = final[0].to(ssm_pages.dtype)
    return out

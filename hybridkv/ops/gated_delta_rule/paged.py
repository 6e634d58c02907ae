"""Gated delta rule over a flat varlen batch, with the state kept in its pages."""

from __future__ import annotations

import torch
from torch import Tensor

from hybridkv.ops.gated_delta_rule.naive import chunk_gated_delta_rule, recurrent_gated_delta_rule
from hybridkv.ops.paged_state import run_on_state_pages


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

    def step(rows: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        o, final = recurrent_gated_delta_rule(
            q[rows, None], k[rows, None], v[rows, None], g[rows, None], beta[rows, None], state
        )
        return o[:, 0], final

    def scan(rows: slice, initial: Tensor | None) -> tuple[Tensor, Tensor]:
        o, final = chunk_gated_delta_rule(
            q[None, rows],
            k[None, rows],
            v[None, rows],
            g[None, rows],
            beta[None, rows],
            None if initial is None else initial[None],
        )
        return o[0], final[0]

    out = torch.empty_like(v)
    return run_on_state_pages(out, ssm_pages, state_pages, has_initial_state, starts, step, scan)

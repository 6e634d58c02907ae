"""Mamba1 selective scan over a step's flat varlen batch, each request's state in its page.

Mamba1 has no chunked closed form (``A`` is per channel and state), so the scan is a token
loop; here it is one loop over the position index shared by a block of requests
(decodes are requests of one position), requests sorted by length so that the ones still
running are a prefix of the block (:class:`~hybridkv.ops.state_layouts.TokenLayout`).
Positions past a request's end read row 0 and their results are never used.
States are read from their pages once, updated in place in fp32 and written back once; a
capture is the state after its position, copied out inside the loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hybridkv.ops.mamba1.naive import discretize, gate_output, selective_scan
from hybridkv.ops.paged_state import (
    StateBatch,
    needs_grad,
    read_states,
    scan_each_request,
    write_states,
)
from hybridkv.ops.state_layouts import TokenLayout
from hybridkv.ops.workspace import WORKSPACE

SLICE_ELEMENTS = 1 << 20  # decay/inject elements precomputed at once (4 MB each in fp32)
# States per block of requests run through the token loop together: about 1 MB of fp32
# state, so the loop's working set stays in cache (one loop over all 64 requests of a
# step was slower than the per-request loop it replaced).
BLOCK_STATE_ELEMENTS = 1 << 18


@dataclass(frozen=True, kw_only=True, slots=True)
class SelectiveScanParams:
    """The input-independent parameters of one Mamba1 layer's SSM."""

    A: Tensor  # [d_inner, N], negative: -exp(A_log)
    D: Tensor | None  # [d_inner] skip
    dt_bias: Tensor | None  # [d_inner], dt_proj.bias


def selective_scan_varlen(
    x: Tensor,
    dt: Tensor,
    B: Tensor,
    C: Tensor,
    z: Tensor | None,
    params: SelectiveScanParams,
    ssm_pages: Tensor,
    states: StateBatch,
) -> Tensor:
    """Run every request of a step, reading and writing its SSM state page in place.

    Args:
        x, dt, z: [T, d_inner] (dt raw); B, C: [T, N]; rows request-major.
        ssm_pages: [num_pages, d_inner, N] the layer's state view (any float dtype).
        states: the step's rows, live pages and captures for this layer's group.

    Returns:
        [T, d_inner] in x's dtype.
    """
    if needs_grad(x, dt, B, C, z, params.A, params.D, params.dt_bias):

        def scan(rows: slice, initial: Tensor | None) -> tuple[Tensor, Tensor]:
            return selective_scan(
                x[rows], dt[rows], params.A, B[rows], C[rows], D=params.D,
                z=None if z is None else z[rows], dt_bias=params.dt_bias, initial_state=initial,
            )  # fmt: skip

        return scan_each_request(torch.empty_like(x), ssm_pages, states, scan)
    d_inner, d_state = params.A.shape
    A = params.A.float()
    dt_rows = discretize(dt, params.dt_bias, True)  # [T, Di]
    rows = (dt_rows, dt_rows * x.float(), B.float(), C.float())
    y = torch.empty(states.num_tokens, d_inner, device=x.device)
    block_requests = max(1, BLOCK_STATE_ELEMENTS // (d_inner * d_state))
    for layout in states.tokens(block_requests):
        ys = _scan_block(rows, A, ssm_pages, layout)  # [L, Rb, Di]
        y.index_copy_(0, layout.slot_rows, ys.flatten(0, 1).index_select(0, layout.slots))
    states.copy_final_captures(ssm_pages)
    return gate_output(y, x, params.D, z)


def _scan_block(
    rows: tuple[Tensor, Tensor, Tensor, Tensor], A: Tensor, view: Tensor, layout: TokenLayout
) -> Tensor:
    """The token loop over one block of requests; y before the skip and gate [L, Rb, Di]."""
    dt_rows, dtx_rows, B_rows, C_rows = rows
    d_inner, d_state = A.shape
    h = read_states(view, layout.pages, layout.fresh, "scan.state")  # [Rb, Di, N]
    ys = torch.empty(*layout.rows.shape, d_inner, device=A.device)  # [L, Rb, Di]
    num_steps, step = len(layout.running), 0
    while step < num_steps:
        running = layout.running[step]
        span = max(1, min(num_steps - step, SLICE_ELEMENTS // (running * d_inner * d_state)))
        picked = layout.rows[step : step + span, :running]  # [s, a]
        shape = (span, running, d_inner, d_state)
        decay = WORKSPACE.get("scan.decay", shape, torch.float32, A.device)
        torch.mul(dt_rows[picked][..., None], A, out=decay).exp_()
        inject = WORKSPACE.get("scan.inject", shape, torch.float32, A.device)
        torch.mul(dtx_rows[picked][..., None], B_rows[picked][:, :, None, :], out=inject)
        C_span = C_rows[picked][..., None]  # [s, a, N, 1]
        for i in range(span):
            count = layout.running[step + i]
            state = h[:count]
            state.mul_(decay[i, :count]).add_(inject[i, :count])
            torch.bmm(state, C_span[i, :count], out=ys[step + i, :count, :, None])
            captures = layout.captures[step + i]
            if captures is not None:
                write_states(view, captures.pages, h[captures.index], "scan.capture")
        step += span
    write_states(view, layout.pages, h, "scan.state")
    return ys

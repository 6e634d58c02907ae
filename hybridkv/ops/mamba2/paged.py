"""Mamba2 SSD over a step's flat varlen batch, each request's state in its page.

One call runs every request of a step: the decodes together through the one-step update,
the prefill chunks of all requests together through the SSD block decomposition of
:func:`~hybridkv.ops.mamba2.naive.ssd_chunk_scan`, whose carry across chunks runs as a
loop over the chunk index shared by all requests (see :mod:`hybridkv.ops.state_layouts`).
States are read from their pages once, updated in place in fp32 and written back once.

A captured state after row ``j`` of a chunk that starts from state ``S``::

    S_j = exp(Acum_j) S + sum_{l <= j} exp(Acum_j - Acum_l) (dt_l x_l) B_l^T
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hybridkv.ops.exp import decay_exp_
from hybridkv.ops.mamba2.naive import (
    NO_DT_LIMIT,
    DtLimit,
    discretize_dt,
    segment_sum,
    ssd_chunk_scan,
)
from hybridkv.ops.paged_state import (
    DecodeRows,
    StateBatch,
    needs_grad,
    read_states,
    scan_each_request,
    write_states,
)
from hybridkv.ops.state_layouts import ChunkLayout, StepCaptures

BLOCK_TOKENS = 1024  # padded rows per block of requests (keeps the chunk tensors in cache)
# Longest chunk run on CPU, whatever the model's chunk_size: in-chunk work per token grows
# with the chunk (L (N + P) per head against 2 N P for the state terms), and a chunk's
# length changes the result only by rounding. benchmarks/README.md has the measurement.
MAX_CHUNK_TOKENS = 64


@dataclass(frozen=True, kw_only=True, slots=True)
class SSDParams:
    """The input-independent parameters of one Mamba2 layer's SSM."""

    A: Tensor  # [H], negative: -exp(A_log)
    D: Tensor | None  # [H] skip
    dt_bias: Tensor | None  # [H]
    chunk_size: int
    dt_limit: DtLimit = NO_DT_LIMIT
    step_dt_limit: DtLimit | None = None  # one-token steps; None: same as dt_limit


def _decode(
    x: Tensor, dt: Tensor, B: Tensor, C: Tensor, A: Tensor, view: Tensor, decodes: DecodeRows
) -> Tensor:
    """One SSM step for every decode (dt discretized), states updated in place: [B, H, P]."""
    batch, heads, head_dim = x.shape
    state = read_states(view, decodes.pages, decodes.fresh, "ssd.state")  # [B, H, P, N]
    state.mul_(torch.exp(dt * A)[..., None, None])
    flat = state.view(batch * heads, head_dim, -1)  # [B*H, P, N]
    per_group = heads // B.shape[1]
    Bh = B.repeat_interleave(per_group, dim=1).view(batch * heads, 1, -1)  # [B*H, 1, N]
    Ch = C.repeat_interleave(per_group, dim=1).view(batch * heads, -1, 1)  # [B*H, N, 1]
    flat.baddbmm_((x * dt[..., None]).view(batch * heads, head_dim, 1), Bh)
    y = torch.bmm(flat, Ch).view(batch, heads, head_dim)
    write_states(view, decodes.pages, state, "ssd.state")
    return y


def _grouped(x: Tensor, groups: int) -> Tensor:
    """[N, H, ...] -> [N, G, H/G, ...] (heads of a B/C group together)."""
    return x.view(x.shape[0], groups, -1, *x.shape[2:])


def _chunks(
    x_dt: Tensor, A_dt: Tensor, B: Tensor, C: Tensor, view: Tensor, layout: ChunkLayout
) -> Tensor:
    """SSD over every multi-token request: y without the D skip, [Tp, H, P] in layout.rows
    order. Inputs are rows: x_dt [T, H, P], A_dt [T, H], B and C [T, G, N], all fp32."""
    # [Nc, H, L, ...] and [Nc, G, L, N]
    x_dt, A_dt, B, C = layout.pad_heads_first([x_dt, A_dt, B, C])
    num_chunks, heads, size, head_dim = x_dt.shape
    groups = B.shape[1]
    A_cum = torch.cumsum(A_dt, dim=-1)  # [Nc, H, L]

    # inside each chunk: scores C_l . B_s decayed from s to l
    upper = layout.strict_upper
    decay = decay_exp_(segment_sum(A_dt), upper)  # [Nc, H, L(l), L(s)]
    scores = (C @ B.transpose(-1, -2))[:, :, None] * _grouped(decay, groups)
    y = (scores.view_as(decay) @ x_dt).view(num_chunks, heads, size, head_dim)
    # the state each chunk adds by its end, from a zero start: [Nc, H, P, N]
    x_end = x_dt * decay_exp_(A_cum[..., -1:] - A_cum)[..., None]
    chunk_states = (_grouped(x_end, groups).transpose(-1, -2) @ B[:, :, None]).flatten(1, 2)
    start_decay = decay_exp_(A_cum.clone())[..., None]  # [Nc, H, L, 1]
    end_decay = start_decay[..., -1:, :]  # [Nc, H, 1, 1]

    state = read_states(view, layout.pages, layout.fresh, "ssd.state")  # [Rp, H, P, N]
    for (first, count), captures in zip(layout.steps, layout.captures, strict=True):
        part, start = slice(first, first + count), state[:count]
        # what each chunk's start state contributes to its outputs
        y_off = C[part][:, :, None] @ _grouped(start, groups).transpose(-1, -2)  # [n,G,H/G,L,P]
        y[part] += y_off.flatten(1, 2) * start_decay[part]
        if captures is not None:
            _capture(view, captures, first, start, x_dt, B, decay, A_cum)
        start.mul_(end_decay[part]).add_(chunk_states[part])
    write_states(view, layout.pages, state, "ssd.state")
    return layout.unpad(y.transpose(1, 2).reshape(-1, heads, head_dim))


def _capture(
    view: Tensor,
    captures: StepCaptures,
    first: int,
    start: Tensor,
    x_dt: Tensor,
    B: Tensor,
    decay: Tensor,
    A_cum: Tensor,
) -> None:
    """Write the states after the captured rows of this step's chunks (module formula)."""
    chunk = captures.index + first
    weights = decay[chunk, :, captures.offset]  # [c, H, L]: exp(Acum_j - Acum_l), 0 past j
    x_j = x_dt[chunk] * weights[..., None]  # [c, H, L, P]
    groups = B.shape[1]
    added = (_grouped(x_j, groups).transpose(-1, -2) @ B[chunk][:, :, None]).flatten(1, 2)
    states = start[captures.index] * torch.exp(A_cum[chunk, :, captures.offset])[..., None, None]
    write_states(view, captures.pages, states.add_(added), "ssd.capture")


def ssd_varlen(
    x: Tensor,
    dt: Tensor,
    B: Tensor,
    C: Tensor,
    params: SSDParams,
    ssm_pages: Tensor,
    states: StateBatch,
) -> Tensor:
    """Run every request of a step, reading and writing its SSM state page in place.

    One-token requests (decodes) use ``params.step_dt_limit``, chunks ``params.dt_limit``.

    Args:
        x: [T, H, P]; dt: [T, H] raw; B, C: [T, G, N]; rows request-major.
        ssm_pages: [num_pages, H, P, N] the layer's state view (any float dtype).
        states: the step's rows, live pages and captures for this layer's group.

    Returns:
        [T, H, P] in x's dtype.
    """
    if needs_grad(x, dt, B, C, params.A, params.D, params.dt_bias):

        def scan(rows: slice, initial: Tensor | None) -> tuple[Tensor, Tensor]:
            return ssd_chunk_scan(
                x[rows], dt[rows], params.A, B[rows], C[rows], chunk_size=params.chunk_size,
                D=params.D, dt_bias=params.dt_bias, dt_limit=params.dt_limit,
                initial_state=initial,
            )  # fmt: skip

        return scan_each_request(torch.empty_like(x), ssm_pages, states, scan)
    xf, Bf, Cf, A = x.float(), B.float(), C.float(), params.A.float()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    decodes = states.decodes
    if decodes is not None:
        step_limit = params.dt_limit if params.step_dt_limit is None else params.step_dt_limit
        rows = decodes.rows
        dt_step = discretize_dt(dt.index_select(0, rows), params.dt_bias, True, step_limit)
        x_step, B_step, C_step = (t.index_select(0, rows) for t in (xf, Bf, Cf))
        y_step = _decode(x_step, dt_step, B_step, C_step, A, ssm_pages, decodes)
        y.index_copy_(0, rows, y_step)
    layouts = states.chunks(min(params.chunk_size, MAX_CHUNK_TOKENS), BLOCK_TOKENS)
    if layouts:
        dt_chunk = discretize_dt(dt, params.dt_bias, True, params.dt_limit)  # [T, H]
        x_dt, A_dt = xf * dt_chunk[..., None], dt_chunk * A
        for layout in layouts:
            y.index_copy_(0, layout.rows, _chunks(x_dt, A_dt, Bf, Cf, ssm_pages, layout))
    states.copy_final_captures(ssm_pages)
    if params.D is not None:
        y += params.D.float()[:, None] * xf
    return y.to(x.dtype)

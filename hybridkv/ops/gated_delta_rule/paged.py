"""Gated delta rule over a step's flat varlen batch, each request's state in its page.

One call runs every request of a step: the decodes together through the one-token
recurrence, the prefill chunks of all requests together through the chunked (WY) form of
:mod:`.naive`, whose inter-chunk loop goes over the chunk index shared by all requests
(see :mod:`hybridkv.ops.state_layouts`). States are read from their pages once, updated in
place in fp32 workspace buffers and written back once.

A captured state after row ``j`` of a chunk that starts from state ``S``::

    S_j = exp(cum_j) S + sum_{i <= j} exp(cum_j - cum_i) k_i v_new_i^T

(``cum`` the in-chunk cumulative log decay, ``v_new`` the chunk's corrected values).
"""

from __future__ import annotations

import torch
from torch import Tensor

from hybridkv.ops.gated_delta_rule.chunk_operands import (
    ChunkOperands,
    chunk_operands,
    per_v_head,
    prepare_rows,
)
from hybridkv.ops.gated_delta_rule.naive import chunk_gated_delta_rule
from hybridkv.ops.gated_delta_rule.packaged_chunks import (
    contiguous_rows,
    package_for,
    run_package,
)
from hybridkv.ops.paged_state import (
    DecodeRows,
    StateBatch,
    needs_grad,
    read_states,
    scan_each_request,
    write_states,
)
from hybridkv.ops.row_copy import index_copy_rows
from hybridkv.ops.state_layouts import ChunkLayout, StepCaptures

BLOCK_TOKENS = 512  # padded rows per block of requests (keeps the chunk tensors in cache)
# Rows per chunk of the chunked form. FLA's GPU kernels use 64; on the CPU 16 is faster at
# every shape measured (one thread, the op alone, chunk 16 / 32 / 64): the small
# Qwen3-Next's GDN (4 k-heads, 8 v-heads of 64, bf16) 32 x 128 tokens 31.6 / 32.8 / 40.9 ms,
# 1 x 1,500: 12.2 / 15.1 / 23.0 ms, 8 x 110: 5.9 / 7.5 / 9.9 ms; Qwen3-Next-80B's shapes
# (16 / 32 heads of 128) 1 x 2,048: 246 / 284 / 325 ms; the tests' tiny model 4 x 130:
# 1.2 / 1.5 / 2.3 ms. A chunk's inverse and its in-chunk products grow with the chunk's
# square per row while the state products per row do not, and at 16 rows the inverse is
# one triangular solve. Sixteen is also the cache block: snapshots fall on chunk ends of a
# prefill that starts at a block boundary.
CHUNK_TOKENS = 16
TRAINING_CHUNK_TOKENS = 64  # the differentiable path's (gated_delta_rule_varlen)


def _decode(
    rows: tuple[Tensor, Tensor, Tensor, Tensor, Tensor],
    view: Tensor,
    decodes: DecodeRows,
    every_row: bool = False,
) -> Tensor:
    """One recurrence step for every decode, states updated in their pages: [B, Hv, Dv].
    ``every_row``: the step's rows are exactly the decodes, in order (nothing to pick).

    The serving layers run their decodes through the GDN mixer's fused step instead
    (:mod:`hybridkv.ops.gated_delta_rule.mixer_decode`, which compiles this recurrence with
    the rest of the mixer); this eager form serves the op's other callers (tests, the
    op benchmark) and that step's eager form.
    """
    if every_row:  # contiguous, as index_select's copies are (the views below need it)
        q, k, v, g, beta = (x.contiguous() for x in rows)
    else:
        q, k, v, g, beta = (x.index_select(0, decodes.rows) for x in rows)  # [B, H, ...]
    q = per_v_head(q, v.shape[1]).contiguous()
    k = per_v_head(k, v.shape[1]).contiguous()
    return decode_in_pages(view, decodes.pages, decodes.fresh, q, k, v, g, beta)


def decode_in_pages(
    view: Tensor,
    pages: Tensor,
    fresh: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
) -> Tensor:
    """The one-token recurrence on the states in ``view[pages]``, updated there, eagerly:
    the states read once into an fp32 workspace buffer, updated there in place in
    transformers' order, written back once.

    q, k [B, Hv, Dk], v [B, Hv, Dv], g (log decay), beta [B, Hv], fp32 and contiguous;
    ``fresh`` [B] bool or None: start from zeros (masked, never multiplied: NaN garbage in
    a fresh page stays out). Returns [B, Hv, Dv] fp32.
    """
    batch, heads, k_dim = k.shape
    state = read_states(view, pages, fresh, "gdn.state")  # [B, Hv, Dk, Dv]
    state.mul_(g.exp()[..., None, None])
    flat = state.view(batch * heads, k_dim, -1)  # [B*Hv, Dk, Dv]
    kv_mem = torch.bmm(k.view(batch * heads, 1, k_dim), flat)  # [B*Hv, 1, Dv]
    delta = (v.view(batch * heads, 1, -1) - kv_mem).mul_(beta.view(batch * heads, 1, 1))
    # S += k delta^T, elementwise as transformers' recurrent form (a rank-1 baddbmm_ takes
    # twice as long: 272 vs 147 us for 64 requests x 8 heads of 64 x 64)
    flat.addcmul_(k.view(batch * heads, k_dim, 1), delta)
    out = torch.bmm(q.view(batch * heads, 1, k_dim), flat).view(batch, heads, -1)
    write_states(view, pages, state, "gdn.state")
    return out


def _chunks(operands: ChunkOperands, view: Tensor, layout: ChunkLayout) -> Tensor:
    """The chunked form's loop over the chunk steps of a layout, from its
    :class:`ChunkOperands`: [Tp, Hv, Dv] in layout.rows order, the states updated in their
    pages and the captures written."""
    w, u, q, intra, k_end, end_decay, k_g, decay, cum = operands
    num_chunks, heads, size, k_dim = w.shape
    v_dim = u.shape[-1]
    state = read_states(view, layout.pages, layout.fresh, "gdn.state")  # [Rp, Hv, Dk, Dv]
    out = torch.empty(num_chunks, heads, size, v_dim, device=q.device)
    # each step's operands cut once, as [n * Hv, ...] matrices: a short prefill runs a
    # step per 16 tokens, and slicing and reshaping every operand in every step cost more
    # ops than its products
    counts = [count for _, count in layout.steps]
    step_rows = [count * heads for count in counts]
    per_step = zip(
        layout.steps,
        layout.captures,
        w.view(-1, size, k_dim).split(step_rows),
        u.view(-1, size, v_dim).split(step_rows),
        q.view(-1, size, k_dim).split(step_rows),
        intra.view(-1, size, size).split(step_rows),
        k_end.view(-1, k_dim, size).split(step_rows),
        end_decay.split(counts),
        out.view(-1, size, v_dim).split(step_rows),
        strict=True,
    )
    for (first, count), captures, w_s, u_s, q_s, intra_s, k_end_s, end_s, out_s in per_step:
        start = state[:count]
        flat = start.view(-1, k_dim, v_dim)
        v_new = torch.baddbmm(u_s, w_s, flat, alpha=-1)  # u - w S: [n * Hv, C, Dv]
        torch.bmm(q_s, flat, out=out_s)
        out_s.baddbmm_(intra_s, v_new)
        if captures is not None and not captures.at_chunk_end:
            v_grouped = v_new.view(count, heads, size, v_dim)
            _capture(view, captures, first, start, k_g, v_grouped, decay, cum)
        start.mul_(end_s)
        flat.baddbmm_(k_end_s, v_new)
        if captures is not None and captures.at_chunk_end:  # the states carried on
            write_states(view, captures.pages, start[captures.index], "gdn.capture")
    write_states(view, layout.pages, state, "gdn.state")
    return layout.unpad(out.transpose(1, 2).reshape(-1, heads, v_dim))


def _capture(
    view: Tensor,
    captures: StepCaptures,
    first: int,
    start: Tensor,
    k: Tensor,
    v_new: Tensor,
    decay: Tensor,
    cum: Tensor,
) -> None:
    """Write the states after the captured rows of this step's chunks (module formula).

    ``k`` is [N, Hk, 1, C, Dk]; the other tensors are on value heads.
    """
    chunk = captures.index + first
    weights = decay[chunk, :, captures.offset]  # [c, Hv, C]: exp(cum_j - cum_i), 0 past j
    k_g = k[chunk]  # [c, Hk, 1, C, Dk]
    k_j = (k_g * weights.view(*k_g.shape[:2], -1, k_g.shape[3], 1)).flatten(1, 2)
    states = start[captures.index] * cum[chunk, :, captures.offset].exp()[..., None, None]
    states += k_j.transpose(-1, -2) @ v_new[captures.index]  # [c, H, Dk, Dv]
    write_states(view, captures.pages, states, "gdn.capture")


def gated_delta_rule_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    ssm_pages: Tensor,
    states: StateBatch,
    chunk_size: int = CHUNK_TOKENS,
    skip_decodes: bool = False,
) -> Tensor:
    """Run every request of a step, reading and writing its state page in place.

    Args:
        q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g (log decay), beta: [T, Hv]; rows request-major.
        ssm_pages: [num_pages, Hv, Dk, Dv] the layer's state view (any float dtype).
        states: the step's rows, live pages and captures for this layer's group.
        chunk_size: the longest chunk of the chunked form (shorter when every request is).
            Inputs that autograd tracks (training) take transformers' chunk of 64 instead:
            what is trained there is checked against transformers' gradients, whose
            rounding follows its chunking (tests/demo).
        skip_decodes: leave the one-token requests out, their rows of the result unset
            (a layer that runs its decodes through a fused step of its own,
            :mod:`hybridkv.ops.gated_delta_rule.mixer_decode`, before this call: the final
            captures copied here then include theirs).

    Returns:
        [T, Hv, Dv] in v's dtype.
    """
    if needs_grad(q, k, v, g, beta):
        if skip_decodes:
            raise ValueError("skip_decodes is for inference steps (no autograd)")

        def scan(rows: slice, initial: Tensor | None) -> tuple[Tensor, Tensor]:
            picked = (x[None, rows] for x in (q, k, v, g, beta))
            init = None if initial is None else initial[None]
            o, final = chunk_gated_delta_rule(*picked, init, chunk_size=TRAINING_CHUNK_TOKENS)
            return o[0], final[0]

        return scan_each_request(torch.empty_like(v), ssm_pages, states, scan)
    raw = (q, k, v, g, beta)
    decode_only = states.decodes is not None and states.decodes.rows.numel() == v.shape[0]
    if decode_only and not skip_decodes:
        assert states.decodes is not None
        out = _decode(prepare_rows(*raw), ssm_pages, states.decodes, every_row=True)
        states.copy_final_captures(ssm_pages)
        return out.to(v.dtype)
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    rows = None  # prepared for the eager forms, when one runs
    if states.decodes is not None and not skip_decodes:
        rows = prepare_rows(*raw)
        index_copy_rows(out, states.decodes.rows, _decode(rows, ssm_pages, states.decodes))
    packed = None  # the rows as a package reads them (contiguous), made once per step
    for layout in states.chunks(chunk_size, BLOCK_TOKENS):  # rows as 16-byte words
        package = package_for(raw, layout)  # the operands compiled ahead of time
        if package is not None:
            packed = contiguous_rows(raw) if packed is None else packed
            operands = run_package(package, packed, layout)
        else:
            rows = prepare_rows(*raw) if rows is None else rows
            operands = chunk_operands(*layout.pad_heads_first(rows), layout.strict_upper)
        index_copy_rows(out, layout.rows, _chunks(operands, ssm_pages, layout))
    states.copy_final_captures(ssm_pages)
    return out.to(v.dtype)

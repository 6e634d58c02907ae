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

import ctypes

import torch
from torch import Tensor

from hybridkv.ops.compiled import CompiledOp
from hybridkv.ops.exp import decay_exp_
from hybridkv.ops.gated_delta_rule.naive import chunk_gated_delta_rule, l2norm
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
from hybridkv.ops.tensor_memo import TensorMemo

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


def _prepare_rows(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """fp32 rows, q and k l2-normalised (still on their Hk heads), q scaled by 1/sqrt(Dk)."""
    q = l2norm(q.float()) * q.shape[-1] ** -0.5
    return q, l2norm(k.float()), v.float(), g.float(), beta.float()


def _per_v_head(x: Tensor, v_heads: int) -> Tensor:
    """[..., Hk, ...] -> [..., Hv, ...] along dim 1 (value head h reads k-head h // r)."""
    rep = v_heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _decode(
    rows: tuple[Tensor, Tensor, Tensor, Tensor, Tensor],
    view: Tensor,
    decodes: DecodeRows,
    every_row: bool = False,
) -> Tensor:
    """One recurrence step for every decode, states updated in their pages: [B, Hv, Dv].
    ``every_row``: the step's rows are exactly the decodes, in order (nothing to pick)."""
    if every_row:  # contiguous, as index_select's copies are (the views below need it)
        q, k, v, g, beta = (x.contiguous() for x in rows)
    else:
        q, k, v, g, beta = (x.index_select(0, decodes.rows) for x in rows)  # [B, H, ...]
    q, k = _per_v_head(q, v.shape[1]), _per_v_head(k, v.shape[1])
    pages, fresh = decodes.pages, decodes.fresh
    if not _decode_in_pages.will_compile():
        return _decode_in_pages(view, view, pages, fresh, q, k, v, g, beta)
    # One compiled graph for every step: dynamo compiles a graph per None-ness and one for
    # a batch of size one, ~1.5 s each at start-up (~5 s on a cold cache). So the mask is
    # always given, and a lone request runs beside an idle row (_decode_alone).
    if fresh is None:
        fresh = torch.zeros(pages.shape, dtype=torch.bool, device=pages.device)
    if pages.numel() == 1:
        return _decode_alone(view, pages, fresh, q, k, v, g, beta)
    return _decode_in_pages(view, _reading_alias(view), pages, fresh, q, k, v, g, beta)


def _decode_alone(view: Tensor, pages: Tensor, fresh: Tensor, *rows: Tensor) -> Tensor:
    """A lone decode as the compiled graph's batch of two, on two scratch pages laid out
    as ``view``'s (same strides and offset, so the same graph runs): its state copied to
    the first, an idle row (zero inputs, a fresh state) on the second, the new state
    copied back. Not on the pages of ``view``: the step updates each page in place, so the
    request's own page listed twice would be updated twice, and any other page of the
    view may be another group's memory (its bytes must not even be rewritten: the view
    spans the whole arena). Same kernel, same bits as in a batch."""
    scratch, both, idle = _lone_scratch(view)
    scratch[:1].copy_(view.index_select(0, pages))
    paired = [torch.cat([fresh, idle]), *(torch.cat([x, torch.zeros_like(x)]) for x in rows)]
    out = _decode_in_pages(scratch, _reading_alias(scratch), both, *paired)[:1]
    index_copy_rows(view, pages, scratch[:1])
    return out


# per page view: (two pages laid out as the view's, their ids [0, 1], the idle row's
# fresh flag [True]), for a lone decode
_LONE_SCRATCH: TensorMemo[tuple[Tensor, Tensor, Tensor]] = TensorMemo()


def _lone_scratch(view: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Two pages with ``view``'s strides and storage offset, their page ids and the idle
    row's fresh flag (remembered per view). Its
    memory spans a page of the arena and a state, but only the two states are ever
    written: left empty, the rest is never touched (not resident). The idle row's state is
    masked as fresh, so whatever its slot holds is never read into a result."""

    def derive() -> tuple[Tensor, Tensor, Tensor]:
        shape = (2, *view.shape[1:])
        extent = view.storage_offset() + 1
        extent += sum((n - 1) * st for n, st in zip(shape, view.stride(), strict=True))
        # built as the engine's views are (an as_strided view of a byte arena seen in the
        # dtype), an inference tensor or not as the view is: dynamo guards on both
        with torch.inference_mode(view.is_inference()):
            arena = torch.empty(extent * view.element_size(), dtype=torch.uint8, device=view.device)
            scratch = torch.as_strided(
                arena.view(view.dtype), shape, view.stride(), view.storage_offset()
            )
        both = torch.arange(2, device=view.device)
        return scratch, both, torch.ones(1, dtype=torch.bool, device=view.device)

    return _LONE_SCRATCH.get((view,), derive)


# per page view, role and mode: a tensor over the view's memory (_reading_alias)
_READ_ALIASES: TensorMemo[Tensor] = TensorMemo()


def _reading_alias(view: Tensor, role: str = "read") -> Tensor:
    """``view``'s memory as a tensor of its own storage object (CPU; elsewhere ``view``
    itself), for a compiled step to read the states from (see
    :func:`_decode_in_pages_fused`), or, with another ``role``, to write them through
    (a step that updates two views of one arena writes one of them through an alias:
    two mutated inputs on one storage are what dynamo cannot compile, below). Made from
    the address with ``torch.frombuffer``: it owns nothing, and is remembered only while
    ``view`` (which keeps the memory) lives; each role is an alias of its own.
    Views of one storage object would not do: torch 2.13 compiles aliased inputs against a
    synthetic base whose size its guards do not check (a second arena of another size then
    failed at run time)."""
    storage = view.untyped_storage()
    if view.device.type != "cpu" or view.numel() == 0 or storage.nbytes() % view.element_size():
        return view

    def derive() -> Tensor:
        memory = (ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())
        flat = torch.frombuffer(memory, dtype=torch.uint8).view(view.dtype)
        return flat.as_strided(view.shape, view.stride(), view.storage_offset())

    key = (role, torch.is_inference_mode_enabled(), storage.data_ptr(), storage.nbytes())
    return _READ_ALIASES.get((view,), derive, key)


def _decode_in_pages_fused(
    view: Tensor,
    source: Tensor,
    pages: Tensor,
    fresh: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
) -> Tensor:
    """The one-token recurrence on the states in ``view[pages]``, updated there.

    The states are read through ``source``, ``view``'s memory as another tensor
    (:func:`_reading_alias`; ``view`` itself works too). Read through the tensor it
    writes, inductor cannot rule out a page listed twice (whose second update would read
    the first's result), so it writes the new states to a temporary buffer and copies
    them into the pages in another pass; read through ``source`` it writes them in place:
    64 requests of the small Qwen3-Next, six layers' pages in turn, one thread, 870 -> 650
    us a layer, the same bits. So each row must have its own page: the engine's decodes
    do, and a lone request runs on scratch pages beside an idle row (:func:`_decode_alone`).

    q, k [B, Hv, Dk], v [B, Hv, Dv], g (log decay), beta [B, Hv], fp32 and contiguous;
    ``fresh`` [B] bool or None: start from zeros (masked, never multiplied: NaN garbage in
    a fresh page stays out). Returns [B, Hv, Dv] fp32.

    The form to compile (:mod:`hybridkv.ops.compiled`): elementwise products and sums that
    inductor turns into one loop reading each state and one writing it, where eager torch
    (:func:`_decode_in_pages_eager`) makes eight passes over the batch's states (gather,
    to fp32, decay, two bmm, update, to the page dtype, scatter). 64 requests of the small
    Qwen3-Next (8 heads of 64 x 64, bf16 pages), one thread: the op ~1.6 -> ~0.9 ms per
    layer (cProfile), a decode step 36 -> 32 ms (medians of 3 interleaved W1 runs each);
    run eagerly, this form would take ~6 ms.
    """
    state = source[pages].float()  # [B, Hv, Dk, Dv]
    if fresh is not None:
        state = state.masked_fill(fresh[:, None, None, None], 0.0)
    decay = g.exp()[..., None]  # [B, Hv, 1]
    # S' = d S + k delta^T with delta = beta (v - d S^T k), and S'^T q = d S^T q + (k . q)
    # delta: both reads of S are one pass over it, the write of S' a second
    s_k = (state * k[..., None]).sum(-2)  # [B, Hv, Dv]
    s_q = (state * q[..., None]).sum(-2)
    delta = (v - decay * s_k) * beta[..., None]
    out = decay * s_q + (k * q).sum(-1, keepdim=True) * delta
    view[pages] = (state * decay[..., None] + k[..., None] * delta[..., None, :]).to(view.dtype)
    return out


def _decode_in_pages_eager(
    view: Tensor,
    source: Tensor,
    pages: Tensor,
    fresh: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
) -> Tensor:
    """:func:`_decode_in_pages_fused` for eager torch: the states read once into an fp32
    workspace buffer, updated there in place in transformers' order, written back once."""
    batch, heads, k_dim = k.shape
    state = read_states(source, pages, fresh, "gdn.state")  # [B, Hv, Dk, Dv]
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


_decode_in_pages = CompiledOp(_decode_in_pages_fused, _decode_in_pages_eager)

# rows of the warm-up's batch: a size no model dimension has (dynamo ties sizes that are
# equal when it traces, and would compile again for every batch of another size)
WARM_UP_BATCH = 13


def warm_up_decode(view: Tensor) -> None:
    """Compile the one-token step for ``view``'s dtype and page layout before serving, on
    the view's first pages, whose bytes are put back (a poisoned cache stays poisoned).
    No-op where the step runs eagerly."""
    if not _decode_in_pages.will_compile():
        return
    heads, k_dim, v_dim = view.shape[1:]
    with torch.inference_mode():  # as the engine's steps: dynamo compiles per mode
        pages = torch.arange(min(WARM_UP_BATCH, view.shape[0]), device=view.device)
        saved = view.index_select(0, pages)
        batch = pages.numel()
        q, k, v, g, beta = (  # distinct tensors: dynamo also compiles per aliasing
            torch.zeros(batch, heads, *dims, device=view.device)
            for dims in ((k_dim,), (k_dim,), (v_dim,), (), ())
        )
        fresh = torch.zeros(batch, dtype=torch.bool, device=view.device)
        _decode_in_pages(view, _reading_alias(view), pages, fresh, q, k, v, g, beta)
        index_copy_rows(view, pages, saved)


INVERSE_BLOCK = 16  # unit_lower_inverse solves blocks up to this size directly
SOLVE_ROWS = 512  # ... and whole batches of at most this many rows (matrices x n)


def unit_lower_inverse(t: Tensor) -> Tensor:
    """Inverse of a batch of unit lower-triangular matrices [..., n, n].

    The chunked form needs ``T^-1 V`` and ``T^-1 K`` for the same ``T``; one inverse and two
    matmuls cost less than two batched triangular solves on CPU, where the solves run at a
    few GFLOP/s on 64x64 matrices. The inverse is built by halves (``[[A, 0], [C, B]]^-1 =
    [[A^-1, 0], [-B^-1 C A^-1, B^-1]]``), so most of its work is matmuls too; blocks of up to
    :data:`INVERSE_BLOCK` rows are solved directly. transformers' chunked form also applies
    an explicit inverse, built row by row.

    A small batch (a short prefill's one chunk) is solved directly whatever its size: the
    halves' dozen ops cost more than the solve there (one thread, interleaved: 4 matrices of
    32: 20 vs 42 us; of 64: 65 vs 113 us; 32 matrices of 64: 490 vs 300 us).
    """
    n = t.shape[-1]
    if n <= INVERSE_BLOCK or t[..., 0, 0].numel() * n <= SOLVE_ROWS:
        eye = torch.eye(n, dtype=t.dtype, device=t.device).expand(t.shape)
        return torch.linalg.solve_triangular(t, eye, upper=False, unitriangular=True)
    half = n // 2
    first = unit_lower_inverse(t[..., :half, :half])
    second = unit_lower_inverse(t[..., half:, half:])
    out = torch.zeros_like(t)
    out[..., :half, :half] = first
    out[..., half:, half:] = second
    out[..., half:, :half] = (second @ t[..., half:, :half] @ first).neg_()
    return out


def _chunks(
    rows: tuple[Tensor, Tensor, Tensor, Tensor, Tensor], view: Tensor, layout: ChunkLayout
) -> Tensor:
    """The chunked form over every multi-token request: [Tp, Hv, Dv] in layout.rows order.

    q·k and k·k are computed once per k-head and shared by its value heads (grouped as
    [N, Hk, r, ...] views of the value-head tensors).
    """
    q, k, v, g, beta = layout.pad_heads_first(rows)  # [N, H, C, ...]
    num_chunks, k_heads, size, k_dim = k.shape
    heads, v_dim = v.shape[1], v.shape[-1]
    grouped = (num_chunks, k_heads, heads // k_heads, size)  # value heads by k-head

    cum = g.cumsum(dim=-1)  # [N, Hv, C]
    upper = layout.strict_upper
    decay = decay_exp_(cum[..., :, None] - cum[..., None, :], upper)  # exp(cum_i - cum_j), i >= j
    decay_g = decay.view(*grouped, size)  # [N, Hk, r, C, C]
    kk = (k @ k.transpose(-1, -2))[:, :, None]  # [N, Hk, 1, C, C]
    ut = (kk * decay_g).mul_(beta.view(*grouped, 1)).view_as(decay)  # unit lower-triangular
    intra = ((q @ k.transpose(-1, -2))[:, :, None] * decay_g).view_as(decay)
    k_g = k[:, :, None]  # [N, Hk, 1, C, Dk]
    ut_inv = unit_lower_inverse(ut)
    u = ut_inv @ v.mul_(beta[..., None])
    start_decay = decay_exp_(cum.clone())  # [N, Hv, C]
    w = ut_inv @ (k_g * (beta * start_decay).view(*grouped, 1)).view(-1, heads, size, k_dim)
    q = (q[:, :, None] * start_decay.view(*grouped, 1)).view(-1, heads, size, k_dim)
    to_end = decay_exp_(cum[..., -1:] - cum).view(*grouped, 1)
    k_end = (k_g * to_end).view(-1, heads, size, k_dim)
    end_decay = start_decay[..., -1, None, None]  # [N, Hv, 1, 1]

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
        k_end.transpose(-1, -2).reshape(-1, k_dim, size).split(step_rows),
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
    rows = _prepare_rows(q, k, v, g, beta)
    decode_only = states.decodes is not None and states.decodes.rows.numel() == v.shape[0]
    if decode_only and not skip_decodes:
        assert states.decodes is not None
        out = _decode(rows, ssm_pages, states.decodes, every_row=True)
        states.copy_final_captures(ssm_pages)
        return out.to(v.dtype)
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    if states.decodes is not None and not skip_decodes:
        index_copy_rows(out, states.decodes.rows, _decode(rows, ssm_pages, states.decodes))
    for layout in states.chunks(chunk_size, BLOCK_TOKENS):  # rows as 16-byte words
        index_copy_rows(out, layout.rows, _chunks(rows, ssm_pages, layout))
    states.copy_final_captures(ssm_pages)
    return out.to(v.dtype)

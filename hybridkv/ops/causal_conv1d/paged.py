"""Causal conv1d over a step's flat varlen batch, each request's state in its page.

Requests (prefill chunks and decodes alike) run in blocks of consecutive requests, each in
one pass over a :class:`~hybridkv.ops.state_layouts.ConvBlock` axis, which puts each
request's carried inputs before its rows: the output of a row is the K-tap window ending
at it, and a state (final or captured) is the K-1 inputs ending at its row. Blocks keep
the arrays in cache (one pass over a whole 8192-row step was slower than the per-request
loop it replaced). Sums run in fp32 and are rounded to the weight dtype before the
activation, as ``nn.Conv1d`` in that dtype rounds them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hybridkv.ops.causal_conv1d.naive import activate, causal_conv1d_fn
from hybridkv.ops.causal_conv1d.packaged import package_for, run_package
from hybridkv.ops.paged_state import (
    DecodeRows,
    StateBatch,
    needs_grad,
    read_states,
    scan_each_request,
    write_states,
)
from hybridkv.ops.row_copy import index_copy_rows, index_select_rows
from hybridkv.ops.state_layouts import ConvBlock
from hybridkv.ops.workspace import WORKSPACE

BLOCK_TOKENS = 512  # rows per block of consecutive requests (keeps the conv in cache)


def causal_conv1d_varlen(
    x: Tensor,
    conv_pages: Tensor,
    states: StateBatch,
    weight: Tensor,
    bias: Tensor | None,
    activation: str | None = None,
    skip_decodes: bool = False,
) -> Tensor:
    """Convolve every request of a step, reading and writing its state page in place.

    Args:
        x: [T, C] request-major rows.
        conv_pages: [num_pages, C, K-1] the layer's state view (any float dtype).
        states: the step's rows, live pages and captures for this layer's group.
        weight: [C, K] depthwise taps; bias: [C] or None. activation: None or "silu".
        skip_decodes: leave the one-token requests out: their rows of the result unset,
            their pages and captures untouched (for a layer that runs its decodes
            through a fused step of its own, and copies their captures itself).

    Returns:
        [T, C] in x's dtype.
    """
    out = torch.empty_like(x)
    if needs_grad(x, weight, bias):
        if skip_decodes:
            raise ValueError("skip_decodes is for inference steps (no autograd)")

        def scan(rows: slice, initial: Tensor | None) -> tuple[Tensor, Tensor]:
            return causal_conv1d_fn(x[rows], weight, bias, initial, activation)

        return scan_each_request(out, conv_pages, states, scan)
    decodes = states.decodes
    every_row = decodes is not None and decodes.rows.numel() == x.shape[0]
    if every_row and not skip_decodes:
        assert decodes is not None
        y = conv_decode(x, conv_pages, decodes, weight, bias, activation)
        states.copy_final_captures(conv_pages)
        return y
    blocks = [] if every_row else states.conv(weight.shape[1], BLOCK_TOKENS, skip_decodes)
    package = package_for(x, weight, bias, activation)  # a block compiled ahead of time
    if package is not None:
        for block in blocks:
            fresh = None if states.fresh is None else states.fresh[block.reqs]
            pages = states.pages[block.reqs]
            carried = read_states(conv_pages, pages, fresh, "conv.state")  # [Rb, C, K-1]
            y, ext = run_package(package, x[block.rows], carried, weight, block)
            out[block.rows] = y
            _write_block_states(ext, conv_pages, pages, block)
        return out
    taps = weight.float().T.contiguous()  # [K, C]: contiguous rows vectorise the taps
    bias = None if bias is None else bias.float()
    for block in blocks:
        fresh = None if states.fresh is None else states.fresh[block.reqs]
        y = _conv_block(
            x[block.rows], conv_pages, states.pages[block.reqs], fresh, block, taps, bias
        )
        out[block.rows] = activate(y.to(weight.dtype), activation)
    return out


def conv_decode(
    x: Tensor,
    conv_pages: Tensor,
    decodes: DecodeRows,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | None = None,
) -> Tensor:
    """One conv step for one-token requests ``x`` [B, C] (the decodes' rows, in order),
    their states shifted in their pages: [B, C] in x's dtype. The same bits as the
    block path's rows (:func:`_decode_step`); captures are the caller's."""
    taps = weight.float().T.contiguous()  # [K, C]: contiguous rows vectorise the taps
    y = _decode_step(x, conv_pages, decodes, taps, None if bias is None else bias.float())
    return activate(y.to(weight.dtype), activation)


def _decode_step(
    x: Tensor, conv_pages: Tensor, decodes: DecodeRows, taps: Tensor, bias: Tensor | None
) -> Tensor:
    """A step of one-token requests (rows in request order): the conv sums [B, C] in fp32;
    each state shifted by one input and written back.

    The sum runs tap by tap in the same order as :func:`_conv_block` (the newest input's
    tap first, then the carried inputs oldest first), so the two paths agree bit for bit;
    this one skips the block layout's row copies and transposes, which cost more than the
    arithmetic at decode sizes. The carried inputs are read tap-major in fp32 in one pass
    (conversion and transpose together), and the next state is built in the page dtype
    (its values are the page's and the input's, so no rounding is skipped) by one
    contiguous shift of the flat [B, C, K-1] buffer, the input written over each row's
    last tap: 64 decodes of 1,536 bf16 channels (the small Qwen3-Next) 343 -> 225 us, 8: 83
    -> 61 us (one thread, interleaved).
    """
    keep = taps.shape[0] - 1
    batch, channels = x.shape
    shape = (batch, channels, keep)
    raw = WORKSPACE.get("conv.decode.page", shape, conv_pages.dtype, x.device)
    index_select_rows(conv_pages, decodes.pages, raw)  # [B, C, K-1]
    if decodes.fresh is not None:
        raw.masked_fill_(decodes.fresh[:, None, None], 0.0)
    columns = WORKSPACE.get("conv.decode.taps", (keep, batch, channels), torch.float32, x.device)
    columns.copy_(raw.permute(2, 0, 1))  # [K-1, B, C]: rows the taps vectorise over
    weights = taps.unbind(0)  # one op for every tap's row, not one select each
    acc = torch.mul(x.float(), weights[keep])
    for column, weight in zip(columns.unbind(0), weights, strict=False):
        acc.addcmul_(column, weight)
    if bias is not None:
        acc.add_(bias)
    shifted = WORKSPACE.get("conv.decode.next", shape, conv_pages.dtype, x.device)
    shifted.view(-1)[:-1].copy_(raw.view(-1)[1:])  # each row's taps move one to the left
    shifted[:, :, keep - 1].copy_(x)  # ... and its last is the new input
    index_copy_rows(conv_pages, decodes.pages, shifted)
    return acc


def _conv_block(
    x: Tensor,
    conv_pages: Tensor,
    pages: Tensor,
    fresh: Tensor | None,
    block: ConvBlock,
    taps: Tensor,
    bias: Tensor | None,
) -> Tensor:
    """The conv sums of one block's rows [Tb, C] in fp32 (before rounding and activation);
    its final and captured states written to their pages."""
    channels, keep = x.shape[1], taps.shape[0] - 1
    ext = WORKSPACE.get("conv.ext", (block.ext_tokens, channels), torch.float32, x.device)
    carried = read_states(conv_pages, pages, fresh, "conv.state")  # [Rb, C, K-1]
    index_copy_rows(ext, block.state_rows, carried.transpose(1, 2).reshape(-1, channels))
    index_copy_rows(ext, block.x_rows, x.float())

    # acc[j] = bias + sum_k w[:, k] * ext[j + k]: the window of the row at ext row j + K-1
    windows = block.ext_tokens - keep
    acc = WORKSPACE.get("conv.acc", (windows, channels), torch.float32, x.device)
    torch.mul(ext[keep:], taps[keep], out=acc)
    for tap in range(keep):
        acc.addcmul_(ext[tap : tap + windows], taps[tap])
    if bias is not None:
        acc.add_(bias)

    _write_block_states(ext, conv_pages, pages, block)
    return acc.index_select(0, block.x_rows - keep)


def _write_block_states(ext: Tensor, conv_pages: Tensor, pages: Tensor, block: ConvBlock) -> None:
    """The block's final states (to its requests' ``pages``) and captured ones, each the
    K-1 rows of the block's axis ``ext`` [E, C] that end at its row."""
    keep, channels = conv_pages.shape[2], ext.shape[1]
    final = ext.index_select(0, block.final_rows).view(-1, keep, channels)  # [Rb, K-1, C]
    write_states(conv_pages, pages, final.transpose(1, 2), "conv.state")
    if block.capture_rows is not None and block.capture_pages is not None:
        captured = ext.index_select(0, block.capture_rows).view(-1, keep, channels)
        write_states(conv_pages, block.capture_pages, captured.transpose(1, 2), "conv.capture")

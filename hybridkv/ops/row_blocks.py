"""Row-wise computations over blocks of rows, their temporaries kept in cache.

A chain of elementwise ops and per-row reductions (a norm) writes a fresh temporary as
large as its input at every op, several in fp32. Over a whole prefill step those are
multi-MB buffers, faulted in fresh and streamed through memory once per op; a block of
rows at a time they stay in a core's L2 cache. The small Qwen3-Next's [4096, 512] bf16
RMSNorm, one thread, cold input, median of 30: 9.5-11 ms in one call, 0.9-1.2 ms in
blocks of 512-1024 rows; its GDN output norm on [32768, 64] 10.4 vs 2.7 ms.

Each row's result is the same bits either way on one thread (every op is row-wise), so
blocking adds no dependence on the size of a step. Blocks (but the last) are multiples of
:data:`BLOCK_ROW_MULTIPLE` rows, so each block's element count is a multiple of ATen's
vector loop step and no element moves into a scalar tail loop, whose exp (in silu) can
round differently: blocks of 5 rows of a 24-wide fp32 gated norm changed an element's
bits, multiples of 64 rows matched the single call at widths 7-1,000 in fp32, bf16 and
fp16, on contiguous rows and on rows split out of wider ones, as the layers pass them;
an input transposed in memory can differ in a few elements of a gated norm's fp32 result.
(With more threads ATen splits an op at a point that depends on its size, so no two step
sizes agree bitwise there, blocked or not.)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

# the most input elements (rows x features, all inputs) a block holds: its fp32
# temporaries (2 MB each at this size) stay in a core's L2 cache
ROW_BLOCK_ELEMENTS = 1 << 19
BLOCK_ROW_MULTIPLE = 64  # rows per block are a multiple of this (module doc)


def by_row_blocks(fn: Callable[..., Tensor], *rows: Tensor) -> Tensor:
    """``fn(*rows)`` for a ``fn`` that is row-wise along dim 0 (row ``i`` of its output
    depends on row ``i`` of the inputs alone), over blocks of rows when the inputs hold
    more than :data:`ROW_BLOCK_ELEMENTS` elements.

    One call when an input has fewer than 2 dims (a 1-D input is one row of a norm), and
    whenever grad mode is on (the blocks write into a buffer, and a trainable weight
    would see its gradient summed in another order). Blocks hold about
    :data:`ROW_BLOCK_ELEMENTS` input elements, and at least 64 rows.
    """
    total = rows[0].numel() if len(rows) == 1 else sum(t.numel() for t in rows)
    if total <= ROW_BLOCK_ELEMENTS or any(t.dim() < 2 for t in rows):  # decode steps
        return fn(*rows)
    num = rows[0].shape[0]
    per_row = sum(math.prod(t.shape[1:]) for t in rows)
    size = ROW_BLOCK_ELEMENTS // max(1, per_row)
    size = max(BLOCK_ROW_MULTIPLE, size // BLOCK_ROW_MULTIPLE * BLOCK_ROW_MULTIPLE)
    if num <= size or torch.is_grad_enabled():  # autograd may track a norm's weight
        return fn(*rows)
    first = fn(*(t[:size] for t in rows))
    out = first.new_empty(num, *first.shape[1:])
    out[:size] = first
    for start in range(size, num, size):
        out[start : start + size] = fn(*(t[start : start + size] for t in rows))
    return out

"""Row gathers and scatters over pages, moved as 16-byte words when the rows allow.

``index_copy_`` and ``index_select`` on CPU cost per *element*, not per byte: writing 64
GDN state pages (4 MB of bf16, 2M elements) into a layer's view takes ~1.3 ms with
``index_copy_``, about the time of the state update itself, where the same bytes seen as
complex128 (one element per 16 bytes) take ~0.14 ms (issue 13's decode profile; the
measurement is in the commit that added this module). The copies move bytes only, so
reinterpreting them is exact, NaN payloads included. Rows that cannot be seen that way
(row bytes not a multiple of 16, a non-contiguous row, an unaligned offset) take the plain
ops, and so do tensors autograd tracks (a dtype view cuts the graph: the demo model trains
through these ops, tests/demo).
"""

from __future__ import annotations

import torch
from torch import Tensor

from hybridkv.ops.tensor_memo import TensorMemo, missing

_WIDE = torch.complex128  # 16-byte elements: the widest dtype whose copies are plain moves


def wide_rows(x: Tensor) -> Tensor | None:
    """``x`` as [rows, row bytes / 16] complex128, or None when its rows are not contiguous
    runs of whole 16-byte words."""
    if x.dim() == 0 or x.dtype == _WIDE or needs_grad(x):
        return None
    rows = x.reshape(x.shape[0], -1) if x.dim() > 2 else x if x.dim() == 2 else x[:, None]
    if rows.data_ptr() != x.data_ptr() or (rows.shape[1] > 1 and rows.stride(1) != 1):
        return None
    if rows.dim() != 2 or rows.shape[1] * x.element_size() % 16 != 0:
        return None
    try:
        return rows.view(_WIDE)
    except RuntimeError:  # stride or storage offset not a multiple of 16 bytes
        return None


# the layer page views and the workspace's views: they live as long as their engine and
# are the source or destination of most row copies. Deriving the wide view takes a reshape
# and a dtype view with their checks, ~1.5 us, and a step makes a few dozen such copies.
_KNOWN_WIDE: TensorMemo[Tensor] = TensorMemo()


def remember_wide_rows(x: Tensor) -> None:
    """Derive ``x``'s 16-byte-word view once, for a tensor that takes part in many copies
    (a layer's page view). Forgotten when ``x`` is freed."""
    wide = wide_rows(x)
    if wide is not None:
        _KNOWN_WIDE.remember((x,), wide)


def _wide(x: Tensor) -> Tensor | None:
    found = _KNOWN_WIDE.lookup((x,))
    if not missing(found) and not needs_grad(x):
        return found  # type: ignore[return-value]
    return wide_rows(x)


def needs_grad(x: Tensor) -> bool:
    """Whether autograd records ops on ``x`` here (then only the plain ops are exact)."""
    return x.requires_grad and torch.is_grad_enabled()


def _same_layout(dst: Tensor, src: Tensor) -> bool:
    return dst.dtype == src.dtype and dst.shape[1:] == src.shape[1:]


def index_copy_rows(dst: Tensor, index: Tensor, src: Tensor) -> Tensor:
    """``dst.index_copy_(0, index, src)``, the rows moved as 16-byte words when possible."""
    if _same_layout(dst, src) and src.shape[0] > 0 and not _is_view_of_other(dst, src):
        wide_dst, wide_src = _wide(dst), _wide(src)
        if wide_dst is not None and wide_src is not None:
            wide_dst.index_copy_(0, index, wide_src)
            return dst
    return dst.index_copy_(0, index, src)


def index_select_rows(src: Tensor, index: Tensor, out: Tensor) -> Tensor:
    """``torch.index_select(src, 0, index, out=out)``, moved as 16-byte words when possible."""
    if _same_layout(out, src) and out.shape[0] > 0 and out.is_contiguous():
        wide_src, wide_out = _wide(src), _wide(out)
        if wide_src is not None and wide_out is not None:
            torch.index_select(wide_src, 0, index, out=wide_out)
            return out
    return torch.index_select(src, 0, index, out=out)


def select_rows(src: Tensor, index: Tensor) -> Tensor:
    """``src.index_select(0, index)`` into a new tensor, moved as 16-byte words when
    possible; the plain op when autograd tracks ``src`` (``out=`` records no graph) or a
    compiler traces it (the graphs of models/decode_graph.py: a compiled gather is its own
    loop, and a trace has no data pointers to check)."""
    if needs_grad(src) or src.dim() == 0 or torch.compiler.is_compiling():
        return src.index_select(0, index)
    return index_select_rows(src, index, src.new_empty(index.numel(), *src.shape[1:]))


def _is_view_of_other(dst: Tensor, src: Tensor) -> bool:
    """True when src may overlap dst (the plain op then decides what that means)."""
    return dst.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()

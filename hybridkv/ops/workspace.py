"""Scratch tensors the recurrent ops reuse from step to step.

A decode step of a 64-request batch moves megabytes of state per layer (GDN: 8 MB in fp32).
Allocating those afresh in every layer and step costs more than the math: each new large
tensor is fresh memory from the OS, so every layer pays its page faults again (issue 13's
profile: ~30% of CPU time in the kernel). The ops instead borrow their state-sized buffers
from here; a buffer grows to the largest size asked for and stays.

A buffer is borrowed for the length of one op call and never returned to a caller, so
layers running one after the other share the same memory. Buffers are per thread.
"""

from __future__ import annotations

import math
import threading

import torch
from torch import Tensor

from hybridkv.ops.row_copy import remember_wide_rows

Shape = tuple[int, ...]
MAX_VIEWS = 512  # views kept per thread (a few per recurrent op and distinct batch size)


class Workspace:
    """Named flat buffers, grown on demand; :meth:`get` returns a view of the right shape."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _buffers(self) -> dict[tuple[str, torch.dtype, torch.device, bool], Tensor]:
        buffers = getattr(self._local, "buffers", None)
        if buffers is None:
            buffers = self._local.buffers = {}
        return buffers

    def _views(self) -> dict[tuple[tuple[str, torch.dtype, torch.device, bool], Shape], Tensor]:
        views = getattr(self._local, "views", None)
        if views is None:
            views = self._local.views = {}
        return views

    def get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        """A contiguous ``shape`` view of buffer ``name``; its contents are garbage.

        Two names never share memory, so an op may hold several buffers at once. The view
        of a shape asked for before is the same tensor again (a decode step asks for the
        same shapes in every layer: two ops each saved, and its row copies find the view's
        16-byte-word form remembered, see hybridkv.ops.row_copy).
        """
        # inference-mode tensors cannot be updated in place outside inference mode (and
        # the engine runs its forward in it): one set of buffers for each side
        key = (name, dtype, device, torch.is_inference_mode_enabled())
        views = self._views()
        view = views.get((key, shape))
        if view is not None:
            return view
        buffers = self._buffers()
        numel = math.prod(shape)
        buf = buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = buffers[key] = torch.empty(numel, dtype=dtype, device=device)
            for stale in [k for k in views if k[0] == key]:  # views of the old buffer
                del views[stale]
        if len(views) >= MAX_VIEWS:  # batch sizes vary from step to step: start afresh
            views.clear()
        view = views[(key, shape)] = buf[:numel].view(shape)
        remember_wide_rows(view)
        return view

    def clear(self) -> None:
        """Drop this thread's buffers (their memory goes back to the allocator)."""
        self._views().clear()
        self._buffers().clear()


WORKSPACE = Workspace()

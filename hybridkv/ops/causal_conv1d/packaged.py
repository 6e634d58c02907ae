"""A block of the varlen causal conv as a package compiled ahead of time.

Eagerly, one block of a prefill's conv (:func:`hybridkv.ops.causal_conv1d.paged._conv_block`
and its caller) is some twenty small ops: the carried inputs and the rows copied into the
block's axis, the taps summed one by one, the sums rounded and activated, the rows picked
back. At a short prefill's sizes dispatch is most of its time (a 60-token prefill of the
tests' tiny Qwen3.5: ~0.57 ms a layer). Exported and compiled by AOTInductor
(:mod:`hybridkv.ops.ahead_of_time`), they are one call; reading the carried states from
their pages and writing the final and captured ones stay eager, shared with the eager
form.

The package sums the taps in the eager form's order but is not its code, so a sum can
round differently (fp32, ~1e-7 relative) before the rounding to the weight dtype, which
it keeps (``PRECISE``); a row's
result depends on its own window alone, whatever shares its step (tested bitwise). The
eager form runs where no package is loaded: ahead-of-time compiling off, ``enforce_eager``,
autograd, another device, a bias, or a layer whose warm-up did not load one.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridkv.ops import ahead_of_time
from hybridkv.ops.ahead_of_time import AheadOfTimeStep
from hybridkv.ops.compiled import compile_enabled
from hybridkv.ops.state_layouts import ConvBlock


def _packaged_block(
    x: Tensor,
    carried: Tensor,
    weight: Tensor,
    state_rows: Tensor,
    x_rows: Tensor,
    ext_ids: Tensor,
    silu: bool,
) -> tuple[Tensor, Tensor]:
    """(outputs [Tb, C] in the weight's dtype, the block's axis ``ext`` [E, C] fp32).

    ``x`` [Tb, C]: the block's rows; ``carried`` [Rb, C, K-1] fp32: their requests' carried
    inputs; ``weight`` [C, K]; ``state_rows``, ``x_rows``: the ext rows of the carried
    inputs and of the rows (``ConvBlock``); ``ext_ids`` [E] (its size is the axis'
    length). The sums run as the eager form runs them: the newest input's tap first, then
    the carried ones oldest first, in fp32, rounded to the weight's dtype, then activated.
    """
    channels = x.shape[1]
    taps = weight.float().T  # [K, C]
    keep = taps.shape[0] - 1
    ext = carried.new_zeros(ext_ids.shape[0], channels)
    ext = ext.index_copy(0, state_rows, carried.transpose(1, 2).reshape(-1, channels))
    ext = ext.index_copy(0, x_rows, x.float())
    windows = ext_ids.shape[0] - keep
    acc = ext[keep:] * taps[keep]
    for tap in range(keep):
        acc = acc + ext[tap : tap + windows] * taps[tap]
    y = acc.index_select(0, x_rows - keep).to(weight.dtype)
    return (F.silu(y) if silu else y), ext


class _Exported(torch.nn.Module):
    """:func:`_packaged_block` as :func:`torch.export.export` takes a function."""

    def __init__(self, silu: bool) -> None:
        super().__init__()
        self.silu = silu

    def forward(
        self,
        x: Tensor,
        carried: Tensor,
        weight: Tensor,
        state_rows: Tensor,
        x_rows: Tensor,
        ext_ids: Tensor,
    ) -> tuple[Tensor, Tensor]:
        return _packaged_block(x, carried, weight, state_rows, x_rows, ext_ids, self.silu)


_SOURCES = (sys.modules[__name__],)  # what the package's code is made of (and PRECISE)
# inductor keeps a rounding to bf16 that a later op reads back in fp32 only when asked:
# without it the SiLU read the fp32 sums, and a bf16 model's logits moved 5x further from
# transformers' (tiny Qwen3-Next: max 0.17 against 0.034)
PRECISE = {"emulate_precision_casts": True}
_DYNAMIC_FIRST = (True, True, False, True, True, True)  # rows, requests, (weight), axis


class Signature(NamedTuple):
    """What a package is built for."""

    x_dtype: torch.dtype
    weight_dtype: torch.dtype
    channels: int
    kernel: int
    silu: bool
    device: str


# packages loaded by warm-ups in this process, by what they serve
_LOADED: dict[Signature, AheadOfTimeStep] = {}


def _example(signature: Signature) -> tuple[Tensor, ...]:
    """Inputs of the package's shapes, sizes no model dimension has: 2 requests of 13 and
    18 rows (export ties sizes that are equal in its example)."""
    keep = signature.kernel - 1
    lens = (13, 18)
    gen = torch.Generator().manual_seed(0)
    state_rows, x_rows = [], []
    at = 0
    for n in lens:
        state_rows += range(at, at + keep)
        x_rows += range(at + keep, at + keep + n)
        at += keep + n
    tensors = (
        torch.rand(sum(lens), signature.channels, generator=gen).to(signature.x_dtype),
        torch.rand(len(lens), signature.channels, keep, generator=gen),
        torch.rand(signature.channels, signature.kernel, generator=gen).to(signature.weight_dtype),
        torch.tensor(state_rows),
        torch.tensor(x_rows),
        torch.arange(at),
    )
    return tuple(t.to(signature.device) for t in tensors)


def warm_up_conv(signature: Signature) -> bool:
    """Load (or build, the first time on this machine) the package for ``signature``;
    whether one serves it now."""
    if signature in _LOADED:
        return True
    if signature.device != "cpu" or not compile_enabled() or not ahead_of_time.available():
        return False
    example = _example(signature)
    name = "conv-block-silu" if signature.silu else "conv-block"
    key = ahead_of_time.package_key(name, _SOURCES, example, _DYNAMIC_FIRST)

    def export() -> torch.export.ExportedProgram:
        # sizes export may relate to each other (the axis holds the rows and the states)
        auto = torch.export.Dim.DYNAMIC
        rows = torch.export.Dim("rows", min=1)
        shapes = ({0: rows}, {0: auto}, None, {0: auto}, {0: rows}, {0: auto})
        return torch.export.export(_Exported(signature.silu), example, dynamic_shapes=shapes)

    step = ahead_of_time.load_or_build(key, export, PRECISE)
    if step is None:
        return False
    _LOADED[signature] = step
    return True


def package_for(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None
) -> AheadOfTimeStep | None:
    """The package that runs this conv's blocks, or None (the eager form): none loaded for
    these dtypes and shapes, a bias, another activation, or the eager mode."""
    if not _LOADED or bias is not None or activation not in (None, "silu"):
        return None
    if not compile_enabled():
        return None
    signature = Signature(
        x.dtype, weight.dtype, weight.shape[0], weight.shape[1], activation == "silu",
        x.device.type,
    )  # fmt: skip
    return _LOADED.get(signature)


def run_package(
    step: AheadOfTimeStep, x: Tensor, carried: Tensor, weight: Tensor, block: ConvBlock
) -> tuple[Tensor, Tensor]:
    """The block's (outputs [Tb, C], axis [E, C] fp32) from ``step`` (:func:`package_for`);
    ``x`` the block's rows, ``carried`` their requests' states (fp32, contiguous)."""
    # a package reads its inputs with the strides it was built for: contiguous ones
    out, ext = step(
        x.contiguous(), carried, weight.contiguous(), block.state_rows, block.x_rows,
        block.ext_ids,
    )  # fmt: skip
    return out, ext

"""A bf16 / fp16 model's matmuls run in fp32 where the CPU only emulates reduced precision.

On a CPU without bf16 matrix instructions (AVX2 alone: no AVX-512 BW/VL/DQ, no
AVX-NE-CONVERT, no AMX) torch multiplies bf16 matrices through a portable loop several
times slower than fp32 (:mod:`hybridkv.ops.cpu_gemm`). A bf16 model spent 94% of a W1-like
run of issue 13 there (64 x 128-token prompts cut to 16, the small Qwen3-Next, one thread:
``aten::mm`` 85%, ``aten::bmm`` 9%).

Here each large matmul weight is held in fp32 instead, converted once at load, and each
product runs as ``fp32(x) @ W32^T`` rounded back to the model dtype. The model stays a
bf16 model: its activations, KV cache and states keep their dtype, and a product differs
from the bf16 kernel's only in the order of its fp32 sums (both accumulate in fp32;
tests/layers/test_fp32_matmul.py). The cost is memory: each upcast weight takes twice its
bytes (the small Qwen3-Next: 84 -> 168 MB). A tied LM head and its embedding share one
fp32 table (:func:`upcast_tied_pair`, which the model calls from its own
``upcast_weights``); a layer that reads a projection's weight by name marks it with
:func:`~hybridkv.layers.packed_linear.keep_plain`, and it stays in the model dtype.

The loader upcasts after loading the checkpoint (the engine's ``cpu_matmul_dtype``: "auto"
does it where :func:`~hybridkv.ops.cpu_gemm.native_gemm` says the model dtype is emulated,
and the copies, counted beforehand by :func:`upcast_extra_bytes`, fit in memory);
``pack_weights`` then packs the fp32 weights for oneDNN like any fp32 model's.

What the bf16 kernel gave and this does not: bit-for-bit the same row whatever the number
of rows in the call. MKL picks its fp32 kernel by the row count, so a row's fp32 sums, and
once in a while its bf16 rounding, depend on what shares the step (as for an fp32 model
served unpacked); greedy answers still equal with caching on and off in the tests
(tests/engine/test_engine_equivalence.py). ``pack_weights`` restores it: packed fp32
products are the same for any row count (tests/layers/test_fp32_matmul.py).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridkv.layers.packed_linear import is_plain, tied_weights

FP32 = torch.float32
REDUCED_DTYPES = (torch.bfloat16, torch.float16)  # the dtypes whose matmuls may be emulated


@runtime_checkable
class UpcastsOwnWeights(Protocol):
    """A module holding matmul weights in its own layout (stacked experts) converts them
    itself when :func:`upcast_linears` asks; returns how many weights it converted."""

    def upcast_weights(self) -> int: ...


class Fp32Linear(nn.Module):
    """``fp32(x) @ W^T + b`` rounded to ``x``'s dtype, around an fp32 ``nn.Linear``.

    The inner linear is an ordinary module, so ``pack_linears`` can still replace it by a
    packed one.
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp32Linear:
        """``linear`` with its weight (and bias) converted to fp32, for inference."""
        inner = _empty_linear(linear.in_features, linear.out_features, linear.bias is not None)
        inner.weight = nn.Parameter(linear.weight.detach().to(FP32), requires_grad=False)
        if linear.bias is not None:
            inner.bias = nn.Parameter(linear.bias.detach().to(FP32), requires_grad=False)
        return cls(inner)

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x.to(FP32)).to(x.dtype)


class Fp32Embedding(nn.Module):
    """Rows of an fp32 table rounded to ``dtype``: the embedding of a tied pair whose LM
    head multiplies in fp32 (:func:`upcast_tied_pair`). The table's values came from
    ``dtype``, so the rounding gives each row back exactly."""

    def __init__(self, weight: nn.Parameter, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = weight
        self.dtype = dtype

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight).to(self.dtype)


def upcast_tied_pair(embedding: nn.Embedding, head: nn.Linear) -> tuple[nn.Module, nn.Module]:
    """(embedding, LM head) sharing one fp32 table, for an LM head tied to the embedding.

    The head is the largest matmul of a step in the small tied models (Qwen3.5-0.8B:
    248,320 x 1,024), so leaving it emulated would leave most of the gain; one fp32 table
    replaces the reduced-precision one for both (twice its bytes), the embedding rounding
    its rows back on lookup. Returns the pair unchanged unless they share a
    reduced-precision weight."""
    weight = embedding.weight
    if head.weight is not weight or weight.dtype not in REDUCED_DTYPES:
        return embedding, head
    table = nn.Parameter(weight.detach().to(FP32), requires_grad=False)
    inner = _empty_linear(head.in_features, head.out_features, bias=False)
    inner.weight = table
    return Fp32Embedding(table, weight.dtype), Fp32Linear(inner)


def _empty_linear(in_features: int, out_features: int, bias: bool) -> nn.Linear:
    """An ``nn.Linear`` whose parameters are on the meta device, to be replaced: built on
    the CPU it would allocate and randomly initialise a weight only to drop it (0.31 s per
    16M elements measured in review: some 5 s and 1 GB for Qwen3.5-0.8B's tied head)."""
    return nn.Linear(in_features, out_features, bias=bias, device="meta")


def upcast_linears(model: nn.Module) -> int:
    """Replace every reduced-precision ``nn.Linear`` of ``model`` that nothing else reads by
    weight by an :class:`Fp32Linear`, in place; modules of their own layout
    (:class:`UpcastsOwnWeights`) convert themselves. A module under several parents is
    converted once and the same converted module put in every place. Inference only.
    Returns the number of weights converted."""
    shared = tied_weights(model)
    replaced: dict[int, nn.Module] = {}
    owners = [m for m in model.modules() if isinstance(m, UpcastsOwnWeights)]
    own = sum(m.upcast_weights() for m in owners)  # may replace children: listed first
    # parents only: a list of every module would keep each replaced Linear (and its
    # reduced-precision weight) alive until the end, adding its bytes to the peak
    parents = [m for m in model.modules() if any(isinstance(c, nn.Linear) for c in m.children())]
    for parent in parents:
        for name, child in list(parent.named_children()):
            if id(child) not in replaced:
                if not _convertible(child, shared):
                    continue
                assert isinstance(child, nn.Linear)
                replaced[id(child)] = Fp32Linear.from_linear(child)
            setattr(parent, name, replaced[id(child)])
    return len(replaced) + own


def upcast_extra_bytes(model: nn.Module) -> int:
    """The bytes :func:`upcast_linears` would add to ``model``: each weight it would hold in
    fp32, less its bytes now. Read from the parameters' shapes and dtypes alone, so the
    loader asks on the model built on meta, before a byte of the checkpoint is read (and
    keeps the model dtype where the copies would not fit). Counted: every parameter of a
    plain reduced-precision linear (a tied LM head's table once: its embedding shares it)
    and those a module of its own layout holds directly (stacked experts). An upper bound:
    a weight some other module reads by identity stays as it is but is counted."""
    seen: set[int] = set()
    extra = 0
    for module in model.modules():
        if not (is_plain(module) or isinstance(module, UpcastsOwnWeights)):
            continue
        for param in module.parameters(recurse=False):
            if param.dtype in REDUCED_DTYPES and id(param) not in seen:
                seen.add(id(param))
                extra += param.numel() * (FP32.itemsize - param.element_size())
    return extra


def _convertible(module: nn.Module, shared: set[int]) -> bool:
    return (
        is_plain(module)
        and isinstance(module, nn.Linear)
        and module.weight.dtype in REDUCED_DTYPES
        and id(module.weight) not in shared
    )


__all__ = [
    "Fp32Embedding",
    "Fp32Linear",
    "UpcastsOwnWeights",
    "upcast_extra_bytes",
    "upcast_linears",
    "upcast_tied_pair",
]

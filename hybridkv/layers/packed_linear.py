"""Linear layers whose weights are pre-packed once for oneDNN on the CPU.

``F.linear`` on the CPU re-lays its weight out (bf16) or goes through a BLAS that may not
use the machine's widest vectors (fp32: MKL picks a narrower path on some AMD CPUs) on
every call. oneDNN can lay a weight out once, in the blocked format its kernel reads, and
then multiply by it directly. Measured on this project's 2-core AMD EPYC (one thread,
``python benchmarks/cpu_matmul_dtypes.py``): bf16 1.2-1.5x faster at 1-16 rows and
1.02-1.14x from 64; fp32 1.7-2.4x faster from 8 rows up, equal at one row on large
weights. The products are bit-identical to ``F.linear`` in bf16, and in fp32 agree to
rounding (~1e-5 relative); packed fp32 products are also the same whatever the number of
rows, where MKL's are not. A packed call costs ~10 us of fixed overhead, so small weights
stay plain (:data:`MIN_PACKED_ELEMENTS`): below 512 x 512 in bf16, and below 1024 x 1024 in
fp32, where a one-row product packed takes 12 us against 6.5 us plain on 512 x 512
(``benchmarks/cpu_matmul_dtypes.py``; equal at 1024 x 1024, 2-2.4x faster from 8 rows).

A compiled graph (the decode and prefill graphs of :mod:`hybridkv.models.decode_graph`)
cannot take an opaque packed tensor as an input, so each packed module has a handle, a 0-d
int64 buffer unique in the process, and a graph calls ``hybridkv::packed_linear`` (or,
for experts packed one by one, ``hybridkv::packed_grouped_linear``) with the handles: the
op finds the weight in a weak registry. In the decode graph of the small Qwen3-Next this
took an 8-request forward from 11.1 to 8.4 ms: there the plain weights went through ``mm``,
re-laid out every call, and the experts' grouped matmul through one ``mm`` per expert at
one to three rows each (~45 us per 512 x 512 weight, cold, against ~27 packed). The
engine packs a small bf16 model by default (``hybridkv.models.loader.packs_by_default``).

The packed weight replaces the plain one (no second copy), so a module is packed only when
nothing else reads its ``.weight``: weights tied to another parameter (an embedding shared
with the LM head) stay plain, and a layer that reads a projection's weight itself marks it
with :func:`keep_plain`. Packing is for inference on the CPU only: the packed tensor is in
oneDNN's opaque layout, cannot move to another device and has no autograd.
"""

from __future__ import annotations

import copy
import functools
import itertools
import weakref
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

# the smallest weight packed, per dtype: below it the fixed cost of a packed call outweighs
# its gain at decode sizes (module doc); dtypes not listed are never packed
MIN_PACKED_ELEMENTS: dict[torch.dtype, int] = {torch.bfloat16: 1 << 18, torch.float32: 1 << 20}

_KEEP_PLAIN = "_hybridkv_keep_plain"


@functools.cache
def can_pack(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs ``dtype`` weights on this CPU: bf16 needs AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT (a CPU with AVX2 alone refuses, and its bf16 model runs fp32 matmuls
    instead: :mod:`hybridkv.layers.fp32_matmul`); fp32 packs wherever oneDNN exists."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype))
    except RuntimeError:
        return False
    return True


def packing_threshold(dtype: torch.dtype, min_elements: int | None = None) -> int | None:
    """The smallest weight of ``dtype`` to pack (``min_elements`` if given and the dtype is
    packable at all), or None: never pack this dtype (none listed, or this CPU cannot)."""
    default = MIN_PACKED_ELEMENTS.get(dtype)
    if default is None or not can_pack(dtype):
        return None
    return default if min_elements is None else min_elements


@runtime_checkable
class PacksOwnWeights(Protocol):
    """A module holding linear weights in its own layout (stacked experts) packs them
    itself when :func:`pack_linears` asks; returns how many weights it packed."""

    def pack_weights(self, min_elements: int | None) -> int: ...


def keep_plain(linear: nn.Linear) -> nn.Linear:
    """Mark ``linear`` as read by weight (``F.linear(x, m.weight)``): never packed."""
    setattr(linear, _KEEP_PLAIN, True)
    return linear


# every live packed linear by its handle (PackedLinear.handle): how a compiled graph, which
# cannot take an opaque packed tensor as an input, names the weight it multiplies by
_BY_HANDLE: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()
_handles = itertools.count(1)


def _packed_product(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _weight_of(handle: int, out_features: int) -> Tensor:
    """The packed weight a graph names by ``handle``, checked against the width the graph
    was compiled for (a mismatch would read or write past the product's rows)."""
    module = _BY_HANDLE.get(handle)
    if module is None:
        raise RuntimeError(f"packed linear {handle} no longer exists (its model was freed)")
    if module.out_features != out_features:
        raise RuntimeError(
            f"packed linear {handle} has {module.out_features} outputs, the graph expects "
            f"{out_features}: a package built for another model"
        )
    return module.packed_weight


def _linear_by_handle(x: Tensor, handle: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    return _packed_product(x, _weight_of(int(handle), out_features), bias)


def _grouped_by_handle(x: Tensor, ends: Tensor, handles: Tensor, out_features: int) -> Tensor:
    bounds = ends.tolist()
    sizes = [end - start for start, end in zip([0, *bounds[:-1]], bounds, strict=True)]
    parts = [
        _packed_product(rows, _weight_of(handle, out_features), None)
        for handle, rows, size in zip(handles.tolist(), x.split(sizes), sizes, strict=True)
        if size > 0
    ]
    return torch.cat(parts) if parts else x.new_empty(0, out_features)


# the ops a graph calls in place of packed modules, by the handles that name their weights.
# torch.library's low-level form: ~3 us a call less than the custom_op wrapper's (26 against
# 29 us for 8 rows of 512 x 512; a decode step of the small Qwen3-Next makes ~60 calls)
_LIBRARY = torch.library.Library("hybridkv", "FRAGMENT")
_LIBRARY.define(
    "packed_linear(Tensor x, Tensor handle, Tensor? bias, SymInt out_features) -> Tensor"
)
_LIBRARY.define(
    "packed_grouped_linear(Tensor x, Tensor ends, Tensor handles, SymInt out_features) -> Tensor"
)
_LIBRARY.impl("packed_linear", _linear_by_handle, "CPU")
_LIBRARY.impl("packed_grouped_linear", _grouped_by_handle, "CPU")


@torch.library.register_fake("hybridkv::packed_linear", lib=_LIBRARY)
def _linear_fake(x: Tensor, handle: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


@torch.library.register_fake("hybridkv::packed_grouped_linear", lib=_LIBRARY)
def _grouped_fake(x: Tensor, ends: Tensor, handles: Tensor, out_features: int) -> Tensor:
    return x.new_empty(x.shape[0], out_features)


# ``x @ W.T + bias`` for the packed linear of ``handle`` (0-d int64): the form a compiled
# graph calls (args: x, handle, bias, out_features)
packed_linear = torch.ops.hybridkv.packed_linear.default
# rows ``x`` [N, in] sorted into groups (group e ends at row ``ends[e]``), each times its
# own packed weight (``handles[e]``), no bias: [N, out]; groups without rows cost nothing.
# A graph's grouped matmul over experts packed one by one (args: x, ends, handles,
# out_features)
packed_grouped_linear = torch.ops.hybridkv.packed_grouped_linear.default


class PackedLinear(nn.Module):
    """``x @ W.T + b`` with ``W`` pre-packed for oneDNN; a drop-in for a CPU ``nn.Linear``.

    Its ``handle`` (a 0-d int64 buffer, unique in the process) names it to the graphs:
    traced, the layer is a call of :func:`packed_linear` by handle, the packed weight
    staying out of the graph's inputs (an opaque tensor export cannot read)."""

    def __init__(self, packed_weight: Tensor, bias: nn.Parameter | None, in_features: int):
        super().__init__()
        self.in_features = in_features
        self.out_features = int(packed_weight.shape[0])
        self.packed_weight = nn.Parameter(packed_weight, requires_grad=False)
        self.bias = bias
        handle = next(_handles)
        self.register_buffer("handle", torch.tensor(handle), persistent=False)
        _BY_HANDLE[handle] = self

    def __deepcopy__(self, memo: dict[int, object]) -> PackedLinear:
        """A twin with a handle of its own (a copied handle would name this module's
        weight to the graphs), sharing the packed weight: inference never writes it."""
        twin = type(self)(self.packed_weight.data, copy.deepcopy(self.bias, memo), self.in_features)
        twin.train(self.training)
        memo[id(self)] = twin
        return twin

    def __copy__(self) -> PackedLinear:
        """A shallow copy, with a handle of its own too (see :meth:`__deepcopy__`)."""
        twin = type(self)(self.packed_weight.data, self.bias, self.in_features)
        twin.train(self.training)
        return twin

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear | None:
        """The packed form of ``linear``, or None where oneDNN cannot pack its dtype here."""
        bias = linear.bias
        if bias is not None:
            bias.requires_grad_(False)  # the packed op has no backward
        return cls.from_weight(linear.weight, bias)

    @classmethod
    def from_weight(cls, weight: Tensor, bias: Tensor | None) -> PackedLinear | None:
        """``x @ weight.T + bias`` packed (weight [out, in] on the CPU), or None where
        oneDNN cannot pack this dtype on this machine."""
        if weight.device.type != "cpu" or packing_threshold(weight.dtype) is None:
            return None
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
        except RuntimeError:  # e.g. fp16 without avx512_fp16 / avx_ne_convert
            return None
        if bias is not None and not isinstance(bias, nn.Parameter):
            bias = nn.Parameter(bias.detach(), requires_grad=False)
        return cls(packed, bias, int(weight.shape[1]))

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling():
            return packed_linear(x, self.handle, self.bias, self.out_features)
        return _packed_product(x, self.packed_weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def is_plain(module: nn.Module) -> bool:
    """A plain ``nn.Linear`` (not a subclass) that nothing reads by weight
    (:func:`keep_plain`): what the load-time weight conversions may replace."""
    return type(module) is nn.Linear and not getattr(module, _KEEP_PLAIN, False)


def _packable(linear: nn.Linear, shared: set[int], min_elements: int | None) -> bool:
    weight = linear.weight
    threshold = packing_threshold(weight.dtype, min_elements)
    return (
        is_plain(linear)
        and id(weight) not in shared
        and weight.device.type == "cpu"
        and threshold is not None
        and weight.numel() >= threshold
    )


def pack_linears(model: nn.Module, *, min_elements: int | None = None) -> int:
    """Replace every packable ``nn.Linear`` of ``model`` by a :class:`PackedLinear`, in place.

    A module reachable under several parents (shared blocks) is packed once and the same
    packed module put in every place; modules with weights of their own layout
    (:class:`PacksOwnWeights`, e.g. stacked experts) pack them themselves. For inference
    only: packed modules have no gradient.
    ``min_elements`` is the smallest weight packed (default: :data:`MIN_PACKED_ELEMENTS`
    of its dtype, read at call time). Returns the number of weights packed.
    """
    if not torch.backends.mkldnn.is_available():
        return 0
    shared = tied_weights(model)
    replaced: dict[int, nn.Module] = {}
    packed_own = 0
    for module in model.modules():
        if isinstance(module, PacksOwnWeights):
            packed_own += module.pack_weights(min_elements)
    # parents only: a list of every module would keep each replaced Linear (and its plain
    # weight) alive until the end, doubling the weights' memory at the peak
    parents = [m for m in model.modules() if any(isinstance(c, nn.Linear) for c in m.children())]
    for parent in parents:
        for child_name, child in list(parent.named_children()):
            if id(child) not in replaced:
                if not isinstance(child, nn.Linear) or not _packable(child, shared, min_elements):
                    continue
                packed = PackedLinear.from_linear(child)
                if packed is None:
                    continue
                replaced[id(child)] = packed
            setattr(parent, child_name, replaced[id(child)])
    return len(replaced) + packed_own


def tied_weights(model: nn.Module) -> set[int]:
    """Ids of parameters held by more than one module (a module under two parents is one)."""
    holders: dict[int, set[int]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), set()).add(id(module))
    return {key for key, modules in holders.items() if len(modules) > 1}


__all__ = [
    "MIN_PACKED_ELEMENTS",
    "PackedLinear",
    "PacksOwnWeights",
    "can_pack",
    "is_plain",
    "keep_plain",
    "pack_linears",
    "packing_threshold",
    "tied_weights",
]

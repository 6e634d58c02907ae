"""fp32 linears of a compiled graph through oneDNN instead of the BLAS.

A graph compiled ahead of time (:mod:`hybridkv.ops.ahead_of_time`) multiplies by its
weights with ``aten::mm``, which on the CPU calls MKL's sgemm. On AMD CPUs MKL runs a
narrower code path than the machine has (``mkl_blas_def_sgemm_kernel_0_zen``, AVX2, on
an AVX-512 EPYC), where oneDNN uses the widest vectors: one thread, the tiny Qwen3.5's
prefill linears at 672 rows (14 requests x 48 tokens), ``F.linear`` 42-274 us against
``mkldnn._linear_pointwise`` 28-111 us (2-3.4x), equal results on those shapes
(``/tmp`` micro-benchmark, 2026-11-27, Zen 5). At decode sizes (64 rows) oneDNN's fixed
cost of ~10 us a call makes it slower on small weights, so only a graph of many rows
(the prefill graph's layers) routes its linears here.

Two pieces, because torch ships neither: :class:`LinearsThroughOneDnn` is a function mode
under which an exported graph records each fp32 CPU ``F.linear`` as
``mkldnn._linear_pointwise`` (the weight stays a plain tensor, an input of the graph);
:func:`input_weight_lowering` lets inductor compile that op with such a weight, calling
oneDNN through its C shim (``aoti_torch_cpu__linear_pointwise``). Inductor's own lowering
asserts that the weight is a constant of the graph (it packs it at compile time, for frozen
models), which a graph taking its weights as inputs (one package per model layout, not
per checkpoint) never has; oneDNN reorders a plain weight inside the call instead, at a
cost measured within 4-10% of a pre-packed one on those shapes.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_LINEAR_POINTWISE = "_linear_pointwise"


@functools.cache
def available() -> bool:
    """Whether this torch has oneDNN and its pointwise linear (and so the C shim)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, _LINEAR_POINTWISE)


class LinearsThroughOneDnn(TorchFunctionMode):
    """Under this mode, ``F.linear`` of fp32 CPU tensors is ``mkldnn._linear_pointwise``
    (the same product, other kernels); anything else runs as it would."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if _fp32_cpu(x, weight, bias):
                return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return func(*args, **kwargs)


def _fp32_cpu(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.dtype == torch.float32 and t.device.type == "cpu") for t in tensors)


def linears_through_onednn() -> contextlib.AbstractContextManager[object]:
    """The mode of :class:`LinearsThroughOneDnn` where oneDNN exists, else nothing."""
    return LinearsThroughOneDnn() if available() else contextlib.nullcontext()


@contextlib.contextmanager
def input_weight_lowering() -> Iterator[None]:
    """While compiling: inductor lowers ``mkldnn._linear_pointwise`` (and the binary form
    its fusion pass makes of a linear and the add after it) with any weight (an input of
    the graph) to a call of oneDNN through the C shim, its own lowerings put back after.
    Nothing changes where this torch lacks either piece."""
    if not available():
        yield
        return
    from torch._inductor import (
        ir,
        lowering,
        mkldnn_ir,
        mkldnn_lowerings,  # noqa: F401  (registers the stock lowering)
    )

    unary, binary = (
        torch.ops.mkldnn._linear_pointwise.default,
        torch.ops.mkldnn._linear_pointwise.binary,
    )

    def rows(t: Any) -> Any:  # [..., K] -> [M, K]
        size = t.get_size()
        return t if len(size) == 2 else lowering.view(t, [-1, size[-1]])

    def shaped(out: Any, like: Any) -> Any:  # [M, N] -> [..., N] as ``like``
        size = like.get_size()
        return out if len(size) == 2 else lowering.view(out, [*size[:-1], out.get_size()[-1]])

    def plain_unary(
        x: Any, weight: Any, bias: Any, attr: str, scalars: Any, algorithm: str, layout: Any = None
    ) -> Any:
        created = mkldnn_ir.LinearUnary.create(rows(x), weight, bias, attr, scalars, algorithm)
        return shaped(ir.TensorBox.create(created), x)

    def plain_binary(
        x: Any, other: Any, weight: Any, bias: Any, attr: str, layout: Any = None
    ) -> Any:
        # (inductor's fusion pass folds an add or the like after a linear into it)
        created = mkldnn_ir.LinearBinary.create(rows(x), rows(other), weight, bias, attr)
        return shaped(ir.TensorBox.create(created), x)

    stock = {op: lowering.lowerings.get(op) for op in (unary, binary)}
    lowering.lowerings[unary] = plain_unary
    lowering.lowerings[binary] = plain_binary
    try:
        yield
    finally:
        for op, saved in stock.items():
            if saved is None:
                lowering.lowerings.pop(op, None)
            else:
                lowering.lowerings[op] = saved

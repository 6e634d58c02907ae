"""The chunked gated delta rule's per-chunk operands as a package compiled ahead of time.

Before its loop over chunk steps, the chunked form prepares its rows (fp32, l2 norms),
pads them into chunks and computes every chunk's operands
(:func:`~hybridkv.ops.gated_delta_rule.chunk_operands.chunk_operands`): some hundred small
ops a layer. At the sizes a short prefill has, their dispatch is most of their time: one
60-token prefill of the tests' tiny Qwen3.5, ~0.48 ms of operands a GDN layer eagerly,
0.13 ms packaged (benchmarks/README.md). Exported and compiled by AOTInductor
(:mod:`hybridkv.ops.ahead_of_time`), the preparation is one call; the loop stays eager and
shared, with its captures (snapshots inside a prefill) as they were. (A package of the
loop too, as a ``while_loop``, was tried: a loop that carries per-step results copies them
every iteration, 42 ms against 1.8 ms for 32 steps of the small Qwen3-Next's shapes.)

The package computes what the eager form computes, in its order, but not its code: sums
can round differently (fp32 throughout, ~1e-7 relative). Each chunk's operands depend on
its own rows alone, so a request's result does not depend on what shares its step (tested
bitwise). Where no package is loaded (ahead-of-time compiling off, ``enforce_eager``,
autograd, another device, a chunk other than 16 rows) the eager form runs.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch
from torch import Tensor

from hybridkv.ops import ahead_of_time, exp, state_layouts
from hybridkv.ops.ahead_of_time import AheadOfTimeStep
from hybridkv.ops.compiled import compile_enabled
from hybridkv.ops.gated_delta_rule import chunk_operands as operands_module
from hybridkv.ops.gated_delta_rule import naive
from hybridkv.ops.gated_delta_rule.chunk_operands import (
    ChunkOperands,
    chunk_operands,
    prepare_rows,
)
from hybridkv.ops.state_layouts import ChunkLayout, pad_together

CHUNK = 16  # the package's chunk length (paged.CHUNK_TOKENS; other layouts stay eager)


def _packaged_operands(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    rows: Tensor,
    slots: Tensor,
    chunk_ids: Tensor,
) -> ChunkOperands:
    """:func:`chunk_operands` of a layout's chunks from the step's rows: ``q``, ``k`` [T,
    Hk, Dk], ``v`` [T, Hv, Dv], ``g``, ``beta`` [T, Hv] in their own dtypes; ``rows`` [Tp]
    the layout's rows of them and ``slots`` [Tp] their slots in the padded axis
    (``ChunkLayout``); ``chunk_ids`` [N] (its size is the number of chunks). The rows
    are prepared (:func:`prepare_rows`) and padded as ``ChunkLayout.pad_heads_first``
    pads them (:func:`pad_together`)."""
    prepared = prepare_rows(*(x.index_select(0, rows) for x in (q, k, v, g, beta)))
    chunks = pad_together(prepared, slots, chunk_ids.shape[0], CHUNK)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    return chunk_operands(*chunks, upper)


class _Exported(torch.nn.Module):
    """:func:`_packaged_operands` as :func:`torch.export.export` takes a function."""

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        rows: Tensor,
        slots: Tensor,
        chunk_ids: Tensor,
    ) -> tuple[Tensor, ...]:
        return tuple(_packaged_operands(q, k, v, g, beta, rows, slots, chunk_ids))


# what the package's code is made of (a change to one is a new package)
_SOURCES = (sys.modules[__name__], operands_module, naive, exp, state_layouts)
_DYNAMIC_FIRST = (True,) * 8  # the step's rows (5), the layout's rows (2), chunks


class Signature(NamedTuple):
    """What a package is built for: the inputs' dtypes and the layer's head shapes."""

    dtypes: tuple[torch.dtype, ...]  # q, k, v, g, beta
    k_heads: int
    k_dim: int
    v_heads: int
    v_dim: int
    device: str


# packages loaded by warm-ups in this process, by what they serve
_LOADED: dict[Signature, AheadOfTimeStep] = {}


def _signature(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Signature:
    return Signature(
        (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype),
        k.shape[1],
        k.shape[2],
        v.shape[1],
        v.shape[2],
        q.device.type,
    )


def _example(signature: Signature) -> tuple[Tensor, ...]:
    """Inputs of the package's shapes with sizes no model dimension has (export ties
    sizes that are equal in its example): 41 rows, 37 of them in 3 chunks."""
    hk, dk, hv, dv = signature.k_heads, signature.k_dim, signature.v_heads, signature.v_dim
    num_rows, block_rows, num_chunks = 41, 37, 3
    gen = torch.Generator().manual_seed(0)
    shapes = ((hk, dk), (hk, dk), (hv, dv), (hv,), (hv,))
    rows = [
        torch.rand(num_rows, *shape, generator=gen).to(dtype)
        for shape, dtype in zip(shapes, signature.dtypes, strict=True)
    ]
    return tuple(
        t.to(signature.device)
        for t in (
            *rows,
            torch.randperm(num_rows, generator=gen)[:block_rows],
            torch.randperm(num_chunks * CHUNK, generator=gen)[:block_rows],
            torch.arange(num_chunks),
        )
    )


def warm_up_chunks(signature: Signature) -> bool:
    """Load (or build, the first time on this machine) the package for ``signature``;
    whether one serves it now. Layers of one shape share it."""
    if signature in _LOADED:
        return True
    if signature.device != "cpu" or not compile_enabled() or not ahead_of_time.available():
        return False
    example = _example(signature)
    key = ahead_of_time.package_key("gdn-chunk-operands", _SOURCES, example, _DYNAMIC_FIRST)

    def export() -> torch.export.ExportedProgram:
        dim = torch.export.Dim
        rows, block, chunks = (dim(n, min=1) for n in ("rows", "block", "chunks"))
        shapes = ({0: rows},) * 5 + ({0: block},) * 2 + ({0: chunks},)
        return torch.export.export(_Exported(), example, dynamic_shapes=shapes)

    step = ahead_of_time.load_or_build(key, export)
    if step is None:
        return False
    _LOADED[signature] = step
    return True


def package_for(rows: Rows, layout: ChunkLayout) -> AheadOfTimeStep | None:
    """The package that computes this layout's operands, or None where none does (the
    caller runs the eager form): no package loaded for these dtypes and shapes, the eager
    mode, or a chunk other than :data:`CHUNK`. ``rows``: the step's q, k, v, g, beta as the
    op takes them."""
    if not _LOADED or layout.chunk_tokens != CHUNK or not compile_enabled():
        return None
    return _LOADED.get(_signature(*rows))


Rows = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]  # q, k, v, g, beta


def contiguous_rows(rows: Rows) -> Rows:
    """The step's rows as a package reads them: with the strides it was built for. The
    layer passes q, k, v as views of its conv's output; copied once per step, not once per
    block of requests."""
    q, k, v, g, beta = (x.contiguous() for x in rows)
    return q, k, v, g, beta


def run_package(step: AheadOfTimeStep, rows: Rows, layout: ChunkLayout) -> ChunkOperands:
    """The layout's :class:`ChunkOperands` from ``step`` (:func:`package_for`); ``rows``
    from :func:`contiguous_rows`. A package checks nothing of its inputs, so this checks
    what it assumes: contiguous rows, int64 contiguous indices."""
    indices = (layout.rows, layout.slots, layout.chunk_ids)
    if not all(x.is_contiguous() for x in rows) or not all(
        i.dtype == torch.int64 and i.is_contiguous() for i in indices
    ):
        raise ValueError("the packaged chunk operands take contiguous rows and int64 indices")
    return ChunkOperands(*step(*rows, *indices))

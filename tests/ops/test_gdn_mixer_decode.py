"""The fused decode step of a GDN mixer (conv update .. gated norm in one compiled graph)
equals the layer's own ops, does not depend on what shares its step, and compiles once."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from hybridkv.ops.causal_conv1d import causal_conv1d_varlen
from hybridkv.ops.compiled import CompiledOp, running_eagerly
from hybridkv.ops.gated_delta_rule import gated_delta_rule_varlen
from hybridkv.ops.gated_delta_rule import mixer_decode as fused
from hybridkv.ops.gated_norm import gated_rms_norm
from hybridkv.ops.paged_state import DecodeRows, StateBatch
from hybridkv.ops.state_layouts import StepRows, build_conv_blocks

K_HEADS, K_DIM, V_HEADS, V_DIM, KERNEL = 2, 16, 4, 12, 4
CHANNELS = 2 * K_HEADS * K_DIM + V_HEADS * V_DIM
CONV = CHANNELS * (KERNEL - 1)
SSM = V_HEADS * K_DIM * V_DIM
OTHER = 40  # elements of some other cache before each page's states


def group_pages(num_pages: int, dtype: torch.dtype, seed: int = 3) -> tuple[Tensor, Tensor, Tensor]:
    """(a byte arena, its conv view [P, C, K-1], its SSM view [P, Hv, Dk, Dv]) laid out as
    the engine's group pages (forward/views.py): each page another cache's slot, then the
    conv state, then the SSM state, both ``as_strided`` views of the arena seen in
    ``dtype``; random values with a NaN and a -0.0 in every page."""
    page = OTHER + CONV + SSM
    gen = torch.Generator().manual_seed(seed)
    typed = (torch.randn(num_pages * page, generator=gen) * 0.5).to(dtype)
    typed[7::page] = float("nan")
    typed[11::page] = -0.0
    arena = typed.view(torch.uint8).clone()
    flat = arena.view(dtype)
    conv = torch.as_strided(flat, (num_pages, CHANNELS, KERNEL - 1), (page, KERNEL - 1, 1), OTHER)
    ssm = torch.as_strided(
        flat, (num_pages, V_HEADS, K_DIM, V_DIM), (page, K_DIM * V_DIM, V_DIM, 1), OTHER + CONV
    )
    return arena, conv, ssm


def weights(dtype: torch.dtype, seed: int = 1) -> fused.MixerWeights:
    gen = torch.Generator().manual_seed(seed)
    return fused.MixerWeights(
        conv=(torch.randn(CHANNELS, 1, KERNEL, generator=gen) * 0.5).to(dtype),
        a_log=torch.randn(V_HEADS, generator=gen) * 0.3,
        dt_bias=torch.randn(V_HEADS, generator=gen).to(dtype),
        norm=(1 + torch.randn(V_DIM, generator=gen) * 0.1).to(dtype),
        norm_eps=1e-6,
    )


def projections(num_rows: int, dtype: torch.dtype, seed: int = 2) -> tuple[Tensor, ...]:
    """A step's (qkv [T, C], z [T, Hv, Dv], b, a [T, Hv]), as the layer's projections."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_rows, CHANNELS, generator=gen)
    z = torch.randn(num_rows, V_HEADS, V_DIM, generator=gen)
    b, a = (torch.randn(num_rows, V_HEADS, generator=gen) for _ in range(2))
    return tuple(t.to(dtype) for t in (qkv, z, b, a))


def decode(
    inputs: tuple[Tensor, ...],
    rows: list[int],
    pages: list[int],
    fresh: list[bool] | None,
    conv: Tensor,
    ssm: Tensor,
    w: fused.MixerWeights,
) -> Tensor:
    """The fused step for decodes at ``rows`` of a step, on inference tensors (the engine's)."""
    with torch.inference_mode():
        decodes = DecodeRows(
            rows=torch.tensor(rows),
            pages=torch.tensor(pages),
            fresh=None if fresh is None else torch.tensor(fresh),
        )
        return fused.gated_deltanet_decode(*(t.clone() for t in inputs), decodes, conv, ssm, w)


def layer_ops(
    inputs: tuple[Tensor, ...],
    pages: list[int],
    fresh: list[bool],
    conv: Tensor,
    ssm: Tensor,
    w: fused.MixerWeights,
) -> Tensor:
    """A decode-only step through the layer's unfused ops: the varlen conv, the varlen
    delta rule and the gated norm (GatedDeltaNet.forward before the fused step)."""
    qkv, z, b, a = inputs
    num = qkv.shape[0]
    key = K_HEADS * K_DIM
    states = StateBatch(list(range(num + 1)), torch.tensor(pages), [not f for f in fresh])
    with torch.inference_mode():
        y = causal_conv1d_varlen(qkv, conv, states, w.conv[:, 0, :], None, "silu")
        q, k, v = y.split([key, key, V_HEADS * V_DIM], dim=-1)
        g = -w.a_log.float().exp() * torch.nn.functional.softplus(a.float() + w.dt_bias)
        o = gated_delta_rule_varlen(
            q.reshape(num, K_HEADS, K_DIM), k.reshape(num, K_HEADS, K_DIM),
            v.reshape(num, V_HEADS, V_DIM), g, b.sigmoid(), ssm, states,
        )  # fmt: skip
        return gated_rms_norm(o, z, w.norm, w.norm_eps).flatten(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_eager_step_is_the_layer_ops_bit_for_bit(dtype: torch.dtype) -> None:
    """Where nothing compiles, the fused step's eager form is the layer's unfused ops (the
    conv's decode step, the recurrence's eager form, the gated norm): the same bits, in
    its outputs and in every byte of the pages, fresh rows over NaN garbage included."""
    pages, fresh = [7, 2, 11, 0, 5], [False, True, False, False, True]
    w, inputs = weights(dtype), projections(len(pages), dtype)
    arena, conv, ssm = group_pages(12, dtype)
    ref_arena, ref_conv, ref_ssm = group_pages(12, dtype)
    with running_eagerly():
        out = decode(inputs, list(range(len(pages))), pages, fresh, conv, ssm, w)
        want = layer_ops(inputs, pages, fresh, ref_conv, ref_ssm, w)
    assert torch.equal(out, want)
    assert torch.equal(arena, ref_arena)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_compiled_step_equals_the_eager_one(
    dtype: torch.dtype, fresh_compile: CompiledOp[..., tuple[Tensor, ...]]
) -> None:
    """Compiled against eager, the decodes picked out of a step with other rows: outputs
    and written states equal up to rounding, no NaN from a fresh row's garbage, and not a
    byte changed outside the decodes' own states."""
    pages, fresh = [7, 2, 11, 0, 5, 9], [False, True, False, False, True, False]
    rows = [1, 2, 4, 5, 8, 9]  # of a 10-row step
    w, inputs = weights(dtype), projections(10, dtype)
    results = []
    for eager in (False, True):
        arena, conv, ssm = group_pages(12, dtype)
        if eager:
            with running_eagerly():
                out = decode(inputs, rows, pages, fresh, conv, ssm, w)
        else:
            out = decode(inputs, rows, pages, fresh, conv, ssm, w)
        results.append((out, arena, conv.clone(), ssm.clone()))
    (out, arena, conv, ssm), (want, want_arena, want_conv, want_ssm) = results
    assert fresh_compile.num_compiled_calls == 1  # the first ran compiled
    assert not out.isnan().any() and not ssm[pages].isnan().any()
    # bf16: the compiled graph keeps some intermediates in fp32 that eager rounds
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 5e-2, "atol": 5e-2}
    torch.testing.assert_close(out.float(), want.float(), **tol)
    torch.testing.assert_close(ssm[pages].float(), want_ssm[pages].float(), **tol)
    assert torch.equal(conv[pages], want_conv[pages])  # a shift: no rounding at all
    before, conv_view, ssm_view = group_pages(12, dtype)
    touched = page_bytes(before, conv_view, pages) | page_bytes(before, ssm_view, pages)
    assert torch.equal(arena[~touched], before[~touched])
    assert torch.equal(want_arena[~touched], before[~touched])


def page_bytes(arena: Tensor, view: Tensor, pages: list[int]) -> Tensor:
    """[arena bytes] bool: the bytes of ``view[pages]``."""
    flags = torch.zeros(arena.numel() // view.element_size(), dtype=torch.int8)
    index = torch.as_strided(
        torch.arange(flags.numel()), view.shape, view.stride(), view.storage_offset()
    )
    flags[index[pages].reshape(-1)] = 1
    return flags.repeat_interleave(view.element_size()).bool()


def test_a_decode_does_not_depend_on_what_shares_its_step(
    fresh_compile: CompiledOp[..., tuple[Tensor, ...]],
) -> None:
    """Cache on and off put a request's decodes in different steps: each decode's output
    and states must be the same bits alone, in a decode-only step and among a mixed
    step's rows, in one compiled graph (a batch of one is not specialised); alone, it
    writes not a byte of the arena (other pages, other caches) but its own states."""
    dtype = torch.bfloat16
    pages = [3, 8, 1, 6]
    w = weights(dtype)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    step = projections(9, dtype)
    rows = [0, 3, 4, 7]  # the decodes' rows in the 9-row mixed step
    mixed_arena, conv, ssm = group_pages(10, dtype)
    mixed = decode(step, rows, pages, None, conv, ssm, w)
    only_arena, conv, ssm = group_pages(10, dtype)
    picked = tuple(t[rows] for t in step)
    only = decode(picked, list(range(len(rows))), pages, None, conv, ssm, w)
    assert torch.equal(mixed, only) and torch.equal(mixed_arena, only_arena)
    for i, (row, page) in enumerate(zip(rows, pages, strict=True)):
        alone_arena, conv, ssm = group_pages(10, dtype)
        alone = decode(tuple(t[row : row + 1] for t in step), [0], [page], None, conv, ssm, w)
        assert alone.shape == (1, V_HEADS * V_DIM) and torch.equal(alone[0], mixed[i])
        mine = page_bytes(alone_arena, conv, [page]) | page_bytes(alone_arena, ssm, [page])
        assert torch.equal(alone_arena[mine], mixed_arena[mine])
        untouched = group_pages(10, dtype)[0]  # not a byte of the arena but its own states
        assert torch.equal(alone_arena[~mine], untouched[~mine])
    assert fresh_compile.num_compiled_calls == 2 + len(rows)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1


def test_warm_up_compiles_the_one_graph_and_puts_the_pages_back(
    fresh_compile: CompiledOp[..., tuple[Tensor, ...]],
) -> None:
    """After warm_up_mixer_decode the pages it ran on hold their bytes again (NaN poison
    included), and steps of one or many decodes compile nothing more."""
    dtype = torch.bfloat16
    arena, conv, ssm = group_pages(20, dtype)
    arena.view(dtype).fill_(float("nan"))
    before = arena.clone()
    w = weights(dtype)
    fused.warm_up_mixer_decode(conv, ssm, w)
    assert fresh_compile.num_compiled_calls == 1
    assert torch.equal(arena, before)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for batch in (1, 5, 17):
        decode(projections(batch + 1, dtype), list(range(batch)), list(range(batch)),
               [True] * batch, conv, ssm, w)  # fmt: skip
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert fresh_compile.num_compiled_calls == 4


def test_conv_blocks_can_leave_the_decodes_out() -> None:
    """multi_token_only: no block holds a one-token request, every longer one is in a block,
    and blocks stay runs of consecutive requests (a decode splits a run)."""
    lens = [1, 5, 7, 1, 1, 30, 2, 1]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    step = StepRows(starts, torch.arange(len(lens)), [True] * len(lens), [])
    blocks = build_conv_blocks(step, KERNEL, 20, multi_token_only=True)
    covered = [r for block in blocks for r in range(block.reqs.start, block.reqs.stop)]
    assert covered == [r for r, n in enumerate(lens) if n > 1]
    assert [(b.reqs.start, b.reqs.stop) for b in blocks] == [(1, 3), (5, 6), (6, 7)]
    everything = build_conv_blocks(step, KERNEL, 20)
    assert [r for b in everything for r in range(b.reqs.start, b.reqs.stop)] == list(range(8))


def test_the_varlen_ops_can_skip_the_decodes() -> None:
    """skip_decodes: the conv and the delta rule leave a mixed step's decodes alone (their
    pages not a byte changed) and give its prefill rows the same bits as without."""
    dtype = torch.float32
    lens, pages = [1, 6, 1, 9], [4, 1, 7, 2]
    starts = [0, 1, 7, 8, 17]
    qkv, _, b, a = projections(starts[-1], dtype)
    w = weights(dtype)
    key = K_HEADS * K_DIM
    prefill_rows = [r for i, n in enumerate(lens) if n > 1 for r in range(starts[i], starts[i + 1])]
    results = []
    for skip in (False, True):
        arena, conv, ssm = group_pages(8, dtype)
        states = StateBatch(starts, torch.tensor(pages), [True, False, True, True])
        with torch.inference_mode():
            y = causal_conv1d_varlen(qkv, conv, states, w.conv[:, 0, :], None, "silu", skip)
            q, k, v = y.split([key, key, V_HEADS * V_DIM], dim=-1)
            g = -w.a_log.exp() * torch.nn.functional.softplus(a + w.dt_bias)
            o = gated_delta_rule_varlen(
                q.reshape(-1, K_HEADS, K_DIM), k.reshape(-1, K_HEADS, K_DIM),
                v.reshape(-1, V_HEADS, V_DIM), g, b.sigmoid(), ssm, states, skip_decodes=skip,
            )  # fmt: skip
        results.append((o[prefill_rows], arena))
    (want, full_arena), (got, skipped_arena) = results
    assert torch.equal(got, want)
    _, conv, ssm = group_pages(8, dtype)
    decoded = page_bytes(full_arena, conv, [4, 7]) | page_bytes(full_arena, ssm, [4, 7])
    before, _, _ = group_pages(8, dtype)
    assert torch.equal(skipped_arena[decoded], before[decoded])
    assert torch.equal(skipped_arena[~decoded], full_arena[~decoded])


def test_the_reading_alias_follows_its_view() -> None:
    """The compiled step reaches a page view through other tensors over its memory: same
    values and layout, a storage object of their own (so dynamo treats them as distinct
    inputs), one per role, remembered per view and mode, and dropped with the view."""
    arena = torch.randn(5, 2, 3, 4, 6).to(torch.bfloat16)
    view = arena[:, 1]
    alias = fused._reading_alias(view)
    assert alias.data_ptr() == view.data_ptr() and alias.stride() == view.stride()
    assert torch.equal(alias, view)
    assert alias.untyped_storage()._cdata != view.untyped_storage()._cdata
    view[2, 1, 0, 0] = 7.0
    assert alias[2, 1, 0, 0] == 7.0  # the same memory
    assert fused._reading_alias(view) is alias
    writer = fused._reading_alias(view, "write")
    assert writer is not alias and writer.untyped_storage()._cdata != alias.untyped_storage()._cdata
    with torch.inference_mode():
        assert fused._reading_alias(view) is not alias
    assert (view,) in fused._READ_ALIASES
    before = len(fused._READ_ALIASES)
    del view, alias, writer
    assert len(fused._READ_ALIASES) == before - 3  # both roles, both modes' read alias

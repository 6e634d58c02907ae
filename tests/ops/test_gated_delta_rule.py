"""Gated delta rule: chunked == recurrent, == transformers' torch path, paged == per request."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from ops_checks import RAGGED_TOKENS, check_varlen_batch
from torch import Tensor

from hybridkv.ops.compiled import CompiledOp
from hybridkv.ops.gated_delta_rule import (
    chunk_gated_delta_rule,
    gated_delta_rule_varlen,
    recurrent_gated_delta_rule,
)
from hybridkv.ops.gated_delta_rule import paged as gdn_module
from hybridkv.ops.paged_state import DecodeRows, StateBatch

hf_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


def make_inputs(n: int, hk: int = 2, hv: int = 4, dk: int = 16, dv: int = 12, batch: int = 1):
    gen = torch.Generator().manual_seed(n * 31 + hv)
    q = torch.randn(batch, n, hk, dk, generator=gen)
    k = torch.randn(batch, n, hk, dk, generator=gen)
    v = torch.randn(batch, n, hv, dv, generator=gen)
    g = -torch.rand(batch, n, hv, generator=gen) * 2  # log decay <= 0
    beta = torch.rand(batch, n, hv, generator=gen)
    state = torch.randn(batch, hv, dk, dv, generator=gen) * 0.5
    return q, k, v, g, beta, state


@pytest.mark.parametrize("n", [1, 5, 64, 70, 130])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunked_equals_recurrent_with_initial_state(n: int, chunk_size: int) -> None:
    q, k, v, g, beta, state = make_inputs(n)
    o1, s1 = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=chunk_size)
    o2, s2 = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(o1, o2, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s1, s2, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("n", [3, 70])
def test_matches_transformers(n: int) -> None:
    q, k, v, g, beta, state = make_inputs(n, batch=2)
    for ours, theirs in [
        (chunk_gated_delta_rule, hf_next.torch_chunk_gated_delta_rule),
        (recurrent_gated_delta_rule, hf_next.torch_recurrent_gated_delta_rule),
    ]:
        o1, s1 = ours(q, k, v, g, beta, state)
        o2, s2 = theirs(
            q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        torch.testing.assert_close(o1, o2, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s1, s2, atol=1e-5, rtol=1e-5)


def test_split_sequence_resumes_from_state() -> None:
    q, k, v, g, beta, _ = make_inputs(50)
    whole, s_whole = chunk_gated_delta_rule(q, k, v, g, beta)
    a, s_a = chunk_gated_delta_rule(q[:, :17], k[:, :17], v[:, :17], g[:, :17], beta[:, :17])
    b, s_b = chunk_gated_delta_rule(q[:, 17:], k[:, 17:], v[:, 17:], g[:, 17:], beta[:, 17:], s_a)
    torch.testing.assert_close(torch.cat([a, b], dim=1), whole, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s_b, s_whole, atol=2e-5, rtol=1e-4)


def test_paged_varlen_equals_each_request_alone() -> None:
    """Decodes and chunks mixed; fresh requests ignore the NaN garbage in their page."""
    lens, fresh = [1, 9, 1, 4], [False, True, True, False]
    q, k, v, g, beta, _ = (t[0] for t in make_inputs(sum(lens)))
    pages = torch.full((8, 4, 16, 12), float("nan"))
    state_pages = torch.tensor([6, 1, 3, 0])
    initial = torch.randn(4, 4, 16, 12)
    for r, page in enumerate(state_pages.tolist()):
        if not fresh[r]:
            pages[page] = initial[r]
    starts = [0, 1, 10, 11, 15]
    states = StateBatch(starts, state_pages, [not f for f in fresh])
    out = gated_delta_rule_varlen(q, k, v, g, beta, pages, states)
    for r, page in enumerate(state_pages.tolist()):
        lo, hi = starts[r], starts[r + 1]
        init = None if fresh[r] else initial[r][None]
        o, s = recurrent_gated_delta_rule(
            q[None, lo:hi], k[None, lo:hi], v[None, lo:hi], g[None, lo:hi], beta[None, lo:hi], init
        )
        torch.testing.assert_close(out[lo:hi], o[0], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(pages[page], s[0], atol=2e-5, rtol=1e-4)
    assert torch.isnan(pages[2]).all()  # pages of no request are untouched


@pytest.mark.parametrize("block_tokens", [None, 40], ids=["one_block", "blocks"])
@pytest.mark.parametrize("with_captures", [False, True], ids=["no_capture", "captures"])
@pytest.mark.parametrize("chunk_size", [12, 16, 64], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("page_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_varlen_equals_each_request_alone(
    page_dtype: torch.dtype,
    chunk_size: int,
    with_captures: bool,
    block_tokens: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ragged prefills and decodes in one call == the chunked reference per request; every
    captured state == the final state of the reference run up to its row."""
    if block_tokens is not None:  # many small blocks of requests
        monkeypatch.setattr(gdn_module, "BLOCK_TOKENS", block_tokens)
    q, k, v, g, beta, _ = (t[0] for t in make_inputs(RAGGED_TOKENS))

    def run_varlen(view: Tensor, states: StateBatch) -> Tensor:
        return gated_delta_rule_varlen(q, k, v, g, beta, view, states, chunk_size)

    run_alone = reference_per_request(chunk_gated_delta_rule, q, k, v, g, beta)
    check_varlen_batch((4, 16, 12), page_dtype, run_varlen, run_alone, with_captures)


def reference_per_request(
    reference: Callable[..., tuple[Tensor, Tensor]], *rows: Tensor
) -> Callable[[slice, Tensor | None], tuple[Tensor, Tensor]]:
    """``run_alone`` for check_varlen_batch: ``reference`` (chunked or recurrent form) over
    one request's rows of q, k, v, g, beta from an initial state (None: zeros)."""

    def run_alone(part: slice, init: Tensor | None) -> tuple[Tensor, Tensor]:
        o, s = reference(*(x[None, part] for x in rows), None if init is None else init[None])
        return o[0], s[0]

    return run_alone


@pytest.mark.parametrize("with_captures", [False, True], ids=["no_capture", "captures"])
@pytest.mark.parametrize("page_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_decode_only_step_equals_each_request_alone(
    page_dtype: torch.dtype, with_captures: bool
) -> None:
    """Every row a decode (the step shape that skips picking the decode rows): fresh and
    carried states, NaN-poisoned pages, captures after the one row; q, k, v strided views
    of one projection, as the layers pass them (a regression: fp32 rows are not copied)."""
    lens, carried = [1] * 7, [True, False, True, True, False, True, True]
    q, k, v, g, beta, _ = (t[0] for t in make_inputs(len(lens)))
    fused = torch.cat([t.flatten(1) for t in (q, k, v)], dim=1)  # [T, q | k | v]
    parts = fused.split([t[0].numel() for t in (q, k, v)], dim=1)
    q, k, v = (p.unflatten(1, t.shape[1:]) for p, t in zip(parts, (q, k, v), strict=True))
    assert not v.is_contiguous()

    def run_varlen(view: Tensor, states: StateBatch) -> Tensor:
        assert states.decodes is not None and states.decodes.rows.numel() == len(lens)
        return gated_delta_rule_varlen(q, k, v, g, beta, view, states)

    run_alone = reference_per_request(recurrent_gated_delta_rule, q, k, v, g, beta)
    check_varlen_batch((4, 16, 12), page_dtype, run_varlen, run_alone, with_captures, lens, carried)


@pytest.mark.parametrize("batch", [3, 24])
@pytest.mark.parametrize("n", [1, 7, 16, 17, 33, 64])
def test_unit_lower_inverse_equals_triangular_solve(n: int, batch: int) -> None:
    """The inverse built by halves (24 x 2 matrices: past SOLVE_ROWS from 17 rows on) or
    solved directly (3 x 2) times a right-hand side == the triangular solve, for sizes that
    are and are not powers of two (a step's chunks are as short as its requests)."""
    gen = torch.Generator().manual_seed(n)
    t = torch.randn(batch, 2, n, n, generator=gen).tril(-1) * 0.3 + torch.eye(n)
    rhs = torch.randn(batch, 2, n, 5, generator=gen)
    want = torch.linalg.solve_triangular(t, rhs, upper=False, unitriangular=True)
    inverse = gdn_module.unit_lower_inverse(t)
    assert torch.equal(inverse.triu(1), torch.zeros_like(inverse))
    torch.testing.assert_close(inverse @ rhs, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(inverse @ t, torch.eye(n).expand_as(t), rtol=1e-5, atol=1e-5)


def test_captures_at_chunk_ends_copy_the_carried_states() -> None:
    """Snapshots that all fall on chunk ends (a prefill from a block boundary in chunks of
    a block) are the states the loop carries on, copied: equal to a forward up to there;
    a capture inside a chunk (row 20) takes the computed path in its step, equal too."""
    from hybridkv.ops.paged_state import StateCaptures

    q, k, v, g, beta, _ = (t[0] for t in make_inputs(40))
    starts, live = [0, 40], 0
    for rows, pages in (([15, 31], [1, 2]), ([15, 20], [1, 2])):
        view = torch.full((3, 4, 16, 12), float("nan"))
        captures = StateCaptures(torch.tensor(rows), torch.tensor(pages))
        states = StateBatch(starts, torch.tensor([live]), [False], captures)
        layout = states.chunks(16, gdn_module.BLOCK_TOKENS)[0]
        at_end = [c.at_chunk_end for c in layout.captures if c is not None]
        assert at_end == ([True, True] if rows == [15, 31] else [True, False])
        gated_delta_rule_varlen(q, k, v, g, beta, view, states, chunk_size=16)
        for row, page in zip(rows, pages, strict=True):
            picked = (x[None, : row + 1] for x in (q, k, v, g, beta))
            _, want = chunk_gated_delta_rule(*picked, None, chunk_size=16)
            torch.testing.assert_close(view[page], want[0], rtol=1e-5, atol=1e-5)


@pytest.fixture
def fresh_compile() -> Iterator[CompiledOp[..., Tensor]]:
    """The decode op with nothing compiled yet in the process (dynamo's caches and the op's
    state reset), so that a test sees what it compiles, never a fallback left by earlier
    tests (dynamo's recompile limit)."""
    op = gdn_module._decode_in_pages
    torch._dynamo.reset()
    op.reset()
    yield op
    torch._dynamo.reset()
    op.reset()


def decode_inputs(
    batch: int, heads: int = 4, k_dim: int = 16, v_dim: int = 12, seed: int = 5
) -> tuple[Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, heads, k_dim, generator=gen) * 0.3 for _ in range(2))
    v = torch.randn(batch, heads, v_dim, generator=gen)
    g = -torch.rand(batch, heads, generator=gen)
    beta = torch.rand(batch, heads, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("with_fresh", [True, False], ids=["fresh", "carried"])
@pytest.mark.parametrize("page_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_compiled_decode_equals_the_eager_one(
    page_dtype: torch.dtype, with_fresh: bool, fresh_compile: CompiledOp[..., Tensor]
) -> None:
    """The one-token recurrence compiled (hybridkv.ops.compiled) against its eager form,
    on strided pages as the cache lays them out, fresh rows over NaN garbage:
    outputs and written states equal up to rounding, every other page untouched."""
    gen = torch.Generator().manual_seed(5)
    heads, k_dim, v_dim, num_pages = 4, 16, 12, 20
    arena = torch.randn(num_pages, 2, heads, k_dim, v_dim, generator=gen).to(page_dtype)
    view = arena[:, 1]  # pages interleaved with another layer's, as in a group page
    pages = torch.tensor([7, 2, 19, 11, 0, 5])
    fresh = torch.tensor([False, True, False, False, True, False]) if with_fresh else None
    if fresh is not None:
        view[pages[fresh]] = float("nan")
    inputs = decode_inputs(len(pages))
    results = []
    with torch.inference_mode():
        for run in (fresh_compile, fresh_compile.eager):
            pages_copy = arena.clone()
            view_copy = pages_copy[:, 1]
            out = run(view_copy, gdn_module._reading_alias(view_copy), pages, fresh, *inputs)
            results.append((out, pages_copy))
    (out, written), (want, want_written) = results
    assert fresh_compile.num_compiled_calls == 1  # the first ran compiled
    assert not out.isnan().any() and not written[:, 1][pages].isnan().any()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(written.float(), want_written.float(), rtol=1e-2, atol=1e-5)
    others = torch.ones(num_pages, dtype=torch.bool)
    others[pages] = False
    assert torch.equal(written[others], arena[others])
    assert torch.equal(written[:, 0], arena[:, 0])


def decode_step(view: Tensor, pages: Tensor, inputs: tuple[Tensor, ...]) -> Tensor:
    """The op's decode path for a step of decodes only (what the layers reach), on
    inference tensors as in the engine (dynamo compiles per mode)."""
    with torch.inference_mode():
        pages = pages.clone()
        decodes = DecodeRows(rows=torch.arange(len(pages)), pages=pages, fresh=None)
        return gdn_module._decode(tuple(x.clone() for x in inputs), view, decodes, every_row=True)


def test_a_compiled_decode_row_is_the_same_alone_and_in_a_batch(
    fresh_compile: CompiledOp[..., Tensor],
) -> None:
    """A lone decode runs the batch graph on scratch pages beside an idle row (one graph
    for every step); each row's output and state must not depend on its batch or
    neighbours, bit for bit: cache on and off put a request in different batches, and must
    still agree exactly."""
    arena = torch.randn(9, 2, 4, 16, 12).to(torch.bfloat16)
    pages = torch.tensor([3, 8, 1, 6])
    inputs = decode_inputs(len(pages))
    together = arena.clone()
    out_together = decode_step(together[:, 1], pages, inputs)
    for row in range(len(pages)):
        alone = arena.clone()
        picked = tuple(x[row : row + 1] for x in inputs)
        out_alone = decode_step(alone[:, 1], pages[row : row + 1], picked)
        assert out_alone.shape == (1, 4, 12) and torch.equal(out_alone[0], out_together[row])
        untouched = torch.ones(len(arena), dtype=torch.bool)
        untouched[pages[row]] = False
        assert torch.equal(alone[pages[row]], together[pages[row]])
        assert torch.equal(alone[untouched], arena[untouched])
    assert fresh_compile.num_compiled_calls == 1 + len(pages)


def engine_pages(
    num_pages: int,
    dtype: torch.dtype,
    seed: int = 3,
    heads: int = 4,
    dims: tuple[int, int] = (16, 12),
) -> tuple[Tensor, Tensor]:
    """(a byte arena, a layer's state view over it) laid out as the engine's
    (forward/views.py): each page holds this state and a 40-element slot of some other
    cache before it, the view an ``as_strided`` of the arena seen in ``dtype``; the arena
    filled with random values, a NaN and a -0.0 in every page (other groups' bytes and
    garbage look like that)."""
    k_dim, v_dim = dims
    state = heads * k_dim * v_dim
    page = 40 + state
    gen = torch.Generator().manual_seed(seed)
    typed = torch.randn(num_pages * page, generator=gen).to(dtype)
    typed[7::page] = float("nan")
    typed[11::page] = -0.0
    typed[45::page] = float("nan")  # inside a state too
    arena = typed.view(torch.uint8).clone()
    view = torch.as_strided(
        arena.view(dtype), (num_pages, heads, k_dim, v_dim), (page, k_dim * v_dim, v_dim, 1), 40
    )
    return arena, view


@pytest.mark.parametrize("page_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_a_lone_decode_writes_no_byte_but_its_state(
    page_dtype: torch.dtype, fresh_compile: CompiledOp[..., Tensor]
) -> None:
    """A lone decode runs on scratch pages beside an idle row: every byte of the arena but
    its own state is left as it was (NaN, -0.0 and other caches' bytes included: the view
    spans the whole arena), first and last page alike; its state and output equal the
    eager step's."""
    for page in (0, 5):
        arena, view = engine_pages(6, page_dtype)
        view[page] = view[page].nan_to_num(0.0)  # a state the step can decode from
        before = arena.clone()
        inputs = tuple(x[:1] for x in decode_inputs(1, seed=page))
        out = decode_step(view, torch.tensor([page]), inputs)
        changed = arena != before
        assert changed.any() and not (changed & ~marked_bytes(arena, view, page)).any()
        eager_arena = before.clone()
        eager_view = torch.as_strided(
            eager_arena.view(page_dtype), view.shape, view.stride(), view.storage_offset()
        )
        with torch.inference_mode():
            want = fresh_compile.eager(
                eager_view, eager_view, torch.tensor([page]), None, *(x.clone() for x in inputs)
            )
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            view[page].float(), eager_view[page].float(), rtol=1e-2, atol=1e-5
        )
    assert fresh_compile.num_compiled_calls == 2


def marked_bytes(arena: Tensor, view: Tensor, page: int) -> Tensor:
    """[arena bytes] bool: the bytes of ``view[page]``."""
    flags = torch.zeros(arena.numel() // view.element_size(), dtype=torch.int8)
    index = torch.as_strided(
        torch.arange(flags.numel()), view.shape, view.stride(), view.storage_offset()
    )
    flags[index[page].reshape(-1)] = 1
    return flags.repeat_interleave(view.element_size()).bool()


def test_the_reading_alias_follows_its_view() -> None:
    """The compiled step reads a page view through another tensor over its memory: same
    values and layout, its own storage object (so dynamo treats the two as distinct
    inputs), remembered per view and mode, and dropped with the view."""
    arena = torch.randn(5, 2, 3, 4, 6).to(torch.bfloat16)
    view = arena[:, 1]
    alias = gdn_module._reading_alias(view)
    assert alias.data_ptr() == view.data_ptr() and alias.stride() == view.stride()
    assert torch.equal(alias, view)
    assert alias.untyped_storage()._cdata != view.untyped_storage()._cdata
    view[2, 1, 0, 0] = 7.0
    assert alias[2, 1, 0, 0] == 7.0  # the same memory
    assert gdn_module._reading_alias(view) is alias
    with torch.inference_mode():
        assert gdn_module._reading_alias(view) is not alias
    assert (view,) in gdn_module._READ_ALIASES
    before = len(gdn_module._READ_ALIASES)
    del view, alias
    assert len(gdn_module._READ_ALIASES) == before - 2  # both modes' entries


def bits(x: Tensor) -> Tensor:
    """The bytes of ``x`` as integers (NaN compares equal to the same NaN)."""
    return x.contiguous().view(torch.int16 if x.element_size() == 2 else torch.int32)


def test_warm_up_compiles_the_one_graph_and_puts_the_pages_back(
    fresh_compile: CompiledOp[..., Tensor],
) -> None:
    """After gdn_module.warm_up_decode, decode steps of one or many rows on the engine's
    page layout (a lone one on scratch pages) compile nothing more; the pages the warm-up
    ran on hold their bytes again (NaN poison included)."""
    arena, view = engine_pages(20, torch.bfloat16)
    view.fill_(float("nan"))
    before = arena.clone()
    gdn_module.warm_up_decode(view)
    assert fresh_compile.num_compiled_calls == 1
    assert torch.equal(arena, before)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for batch in (1, 5, 17):
        decode_step(view, torch.arange(batch), decode_inputs(batch))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert fresh_compile.num_compiled_calls == 4

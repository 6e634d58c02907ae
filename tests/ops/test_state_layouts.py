"""The step layouts of the recurrent ops, checked on their own against plain Python.

The ops' tests compare whole forwards with references; these pin the layouts' own
contracts: which rows go where (chunk-index-major, requests sorted by chunk count), and
that padding puts each row where its slot says, zeros elsewhere, by either path.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from hybridkv.ops import state_layouts
from hybridkv.ops.state_layouts import StepRows, build_chunk_layouts, build_conv_blocks

LENS = [1, 5, 33, 70, 1, 16]  # decodes (1) beside prefill chunks of every shape


def step_rows(lens: list[int], captures: list[tuple[int, int, int]] = ()) -> StepRows:
    starts = [0, *itertools.accumulate(lens)]
    pages = torch.arange(len(lens)) + 100
    return StepRows(starts, pages, [r % 2 == 0 for r in range(len(lens))], list(captures))


@pytest.mark.parametrize("max_chunk, block_tokens", [(64, 512), (32, 512), (16, 48)])
def test_chunk_layout_rows_slots_and_steps(max_chunk: int, block_tokens: int) -> None:
    """Every multi-token row once, each request's rows together and in order; chunk c of
    the request of rank k (sorted by chunk count, longest first, ties in step order) is
    chunk offsets[c] + k; pages sorted alike."""
    states = step_rows(LENS)
    multi = [r for r, n in enumerate(LENS) if n > 1]
    layouts = build_chunk_layouts(states, multi, max_chunk, block_tokens)
    seen: list[int] = []
    for layout in layouts:
        size = layout.chunk_tokens
        rows = layout.rows.tolist()  # the block's requests, each one's rows in order
        reqs = sorted(
            (r for r in multi if states.starts[r] in rows),
            key=lambda r: rows.index(states.starts[r]),
        )
        chunks = {r: -(-LENS[r] // size) for r in reqs}
        order = sorted(sorted(reqs), key=lambda r: -chunks[r])  # ties in step order
        offsets = [first for first, _ in layout.steps]
        assert [count for _, count in layout.steps] == [
            sum(1 for r in reqs if chunks[r] > c) for c in range(chunks[order[0]])
        ]
        want_rows, want_slots = [], []
        for r in reqs:
            for t in range(LENS[r]):
                want_rows.append(states.starts[r] + t)
                chunk = offsets[t // size] + order.index(r)
                want_slots.append(chunk * size + t % size)
        assert layout.rows.tolist() == want_rows and layout.slots.tolist() == want_slots
        assert layout.pages.tolist() == [100 + r for r in order]
        seen += want_rows
    assert sorted(seen) == [states.starts[r] + t for r in multi for t in range(LENS[r])]


@pytest.mark.parametrize("fused_limit", [0, 1 << 30])
def test_padding_places_every_row_by_either_path(
    fused_limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both paths (each tensor alone; all at once) give [N, H, C, ...] with each row at
    its slot and zeros between; unpad takes the rows back."""
    monkeypatch.setattr(state_layouts, "FUSED_PAD_ELEMENTS", fused_limit)
    states = step_rows(LENS)
    multi = [r for r, n in enumerate(LENS) if n > 1]
    [layout] = build_chunk_layouts(states, multi, 32, 4096)
    gen = torch.Generator().manual_seed(0)
    total = states.num_tokens
    xs = [torch.randn(total, 3, 4, generator=gen), torch.randn(total, 2, generator=gen)]
    padded = layout.pad_heads_first(xs)
    size = layout.chunk_tokens
    for x, out in zip(xs, padded, strict=True):
        assert out.shape == (layout.num_chunks, x.shape[1], size, *x.shape[2:])
        want = torch.zeros_like(out)
        for row, slot in zip(layout.rows.tolist(), layout.slots.tolist(), strict=True):
            want[slot // size, :, slot % size] = x[row]
        assert torch.equal(out, want)
        flat = out.movedim(1, 2).reshape(layout.num_chunks * size, *x.shape[1:])
        assert torch.equal(layout.unpad(flat), x[layout.rows])


def test_conv_blocks_put_carried_inputs_before_each_request() -> None:
    """ext = [state_r | rows of r | state_r+1 | ...]: each row, carried input, final state
    and captured state at the ext row the module doc gives."""
    keep = 3
    states = step_rows(LENS, captures=[(2, 10, 7), (3, 69, 8)])
    [block] = build_conv_blocks(states, keep + 1, 4096)
    firsts, at = [], 0
    for n in LENS:
        firsts.append(at)
        at += keep + n
    assert block.ext_tokens == at
    assert block.x_rows.tolist() == [
        f + keep + t for f, n in zip(firsts, LENS, strict=True) for t in range(n)
    ]
    assert block.state_rows.tolist() == [f + t for f in firsts for t in range(keep)]
    ends = [f + keep + n for f, n in zip(firsts, LENS, strict=True)]
    assert block.final_rows.tolist() == [e - keep + t for e in ends for t in range(keep)]
    assert block.capture_pages is not None and block.capture_pages.tolist() == [7, 8]
    wanted = [firsts[2] + keep + 10, firsts[3] + keep + 69]
    assert block.capture_rows is not None
    assert block.capture_rows.tolist() == [w - keep + 1 + t for w in wanted for t in range(keep)]

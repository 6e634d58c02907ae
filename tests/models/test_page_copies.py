"""The runner's whole-page state copies (ModelRunner.copy_pages): restores and snapshots.

A group's copies go as one gather and scatter when no copy writes a page another reads,
else one by one in order; both must move exactly the bytes of each page.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridkv.core.layout import build_layout
from hybridkv.core.manager import StateCopy
from hybridkv.engine.runner import ModelRunner


def _runner(get_tiny: Any) -> ModelRunner:
    _, lm = get_tiny("qwen3_5_text")
    layout = build_layout(lm.spec.groups, 16, 4 << 20)
    runner = ModelRunner(lm.model, lm.spec, layout, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    runner.arena.copy_(torch.randint(0, 256, runner.arena.shape, generator=generator))
    return runner


def _expected(runner: ModelRunner, copies: list[StateCopy]) -> torch.Tensor:
    """The arena after ``copies`` done one by one, in order."""
    arena = runner.arena.clone()
    for copy in copies:
        size = runner.layout.pages[copy.group_id].page_bytes
        arena[copy.dst_page * size : (copy.dst_page + 1) * size] = arena[
            copy.src_page * size : (copy.src_page + 1) * size
        ].clone()
    return arena


def test_many_copies_of_two_groups_at_once(get_tiny: Any) -> None:
    runner = _runner(get_tiny)
    copies = [
        StateCopy(p.group_id, 3 + i, 20 + 2 * i) for p in runner.layout.pages for i in range(5)
    ]
    expected = _expected(runner, copies)
    runner.copy_pages(iter(copies))  # any iterable, read once
    assert torch.equal(runner.arena, expected)
    assert runner.num_page_copies == len(copies)


def test_a_copy_that_reads_a_page_another_writes_goes_in_order(get_tiny: Any) -> None:
    runner = _runner(get_tiny)
    group = runner.layout.pages[0].group_id
    copies = [StateCopy(group, 3, 4), StateCopy(group, 4, 5), StateCopy(group, 7, 8)]
    expected = _expected(runner, copies)  # page 5 ends with page 3's bytes
    runner.copy_pages(copies)
    assert torch.equal(runner.arena, expected)
    size = runner.layout.pages[0].page_bytes
    assert torch.equal(runner.arena[5 * size : 6 * size], runner.arena[3 * size : 4 * size])

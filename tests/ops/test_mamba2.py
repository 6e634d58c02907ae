"""Mamba2 SSD reference against transformers' torch path and a token-by-token recurrence."""

from __future__ import annotations

import math

import pytest
import torch
from ops_checks import (
    NUM_TOKENS,
    RAGGED_LENS,
    RAGGED_TOKENS,
    check_paged_batch,
    check_varlen_batch,
    rel_err,
)
from torch import Tensor

from hybridkv.ops.mamba2 import SSDParams, ssd_chunk_scan, ssd_state_update, ssd_varlen
from hybridkv.ops.mamba2 import paged as ssd_module
from hybridkv.ops.paged_state import StateBatch

hf_bamba = pytest.importorskip("transformers.models.bamba.modeling_bamba")

# (seq_len, num_heads, head_dim, d_state, n_groups, chunk_size)
SHAPES = [
    (1, 4, 8, 16, 1, 16),
    (37, 4, 8, 16, 1, 16),  # crosses two chunk boundaries, ragged tail
    (50, 6, 4, 8, 3, 8),  # groups > 1, 2 heads per group
    (33, 6, 5, 12, 2, 16),  # 3 heads per group, odd head_dim
    (64, 8, 16, 32, 4, 32),  # length a multiple of the chunk
]


def _ids(shape: tuple[int, ...]) -> str:
    return "T{}-H{}-P{}-N{}-G{}-L{}".format(*shape)


def make_inputs(
    seq_len: int, heads: int, head_dim: int, d_state: int, groups: int, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random SSM inputs at the scale a real layer sees (dt raw around 0, A in [-8, -1])."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    return {
        "x": randn(seq_len, heads, head_dim),
        "dt": randn(seq_len, heads) * 0.5,
        "A": -torch.exp(torch.rand(heads, generator=gen) * math.log(8)),
        "B": randn(seq_len, groups, d_state),
        "C": randn(seq_len, groups, d_state),
        "D": randn(heads),
        "dt_bias": randn(heads) * 0.5,
        "state": randn(heads, head_dim, d_state),
    }


def scan(
    t: dict[str, torch.Tensor], part: slice = slice(None), **kw: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ssd_chunk_scan` over the tokens ``part`` of ``t``, with its D and dt_bias."""
    return ssd_chunk_scan(
        t["x"][part],
        t["dt"][part],
        t["A"],
        t["B"][part],
        t["C"][part],
        D=t["D"],
        dt_bias=t["dt_bias"],
        **kw,
    )


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
def test_chunk_scan_matches_transformers(shape: tuple[int, ...], with_state: bool) -> None:
    *dims, chunk = shape
    t = make_inputs(*dims)
    init = t["state"] if with_state else None
    y, final = scan(t, chunk_size=chunk, initial_state=init)
    want_y, want_final = hf_bamba.mamba2_chunk_scan(
        t["x"][None],
        t["dt"][None],
        t["A"],
        t["B"][None],
        t["C"][None],
        chunk_size=chunk,
        D=t["D"],
        dt_bias=t["dt_bias"],
        dt_softplus=True,
        return_final_states=True,
        initial_states=None if init is None else init[None],
    )
    assert y.shape == t["x"].shape and final.shape == t["state"].shape
    assert rel_err(y, want_y[0]) <= 1e-5
    assert rel_err(final, want_final[0]) <= 1e-5


def recurrence(t: dict[str, torch.Tensor], **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
    """The literal recurrence: one state update per token."""
    state = t["state"].clone()[None]
    ys = [
        ssd_state_update(
            state,
            t["x"][i : i + 1],
            t["dt"][i : i + 1],
            t["A"],
            t["B"][i : i + 1],
            t["C"][i : i + 1],
            D=t["D"],
            dt_bias=t["dt_bias"],
            **kwargs,
        )
        for i in range(t["x"].shape[0])
    ]
    return torch.cat(ys), state[0]


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
@pytest.mark.parametrize("dt_limit", [(0.0, math.inf), (0.3, 1.2)], ids=["no_limit", "limit"])
def test_chunk_scan_matches_token_recurrence(
    shape: tuple[int, ...], dt_limit: tuple[float, float]
) -> None:
    *dims, chunk = shape
    t = make_inputs(*dims, seed=1)
    want_y, want_final = recurrence(t, dt_limit=dt_limit)
    y, final = scan(t, chunk_size=chunk, dt_limit=dt_limit, initial_state=t["state"])
    assert rel_err(y, want_y) <= 1e-5
    assert rel_err(final, want_final) <= 1e-5


@pytest.mark.parametrize("split", [1, 7, 16, 33])
def test_split_prefill_equals_unsplit(split: int) -> None:
    t = make_inputs(50, 6, 4, 8, 3, seed=2)
    y1, mid = scan(t, slice(0, split), chunk_size=16, initial_state=t["state"])
    y2, final = scan(t, slice(split, None), chunk_size=16, initial_state=mid)
    want_y, want_final = scan(t, chunk_size=16, initial_state=t["state"])
    assert rel_err(torch.cat([y1, y2]), want_y) <= 1e-5
    assert rel_err(final, want_final) <= 1e-5


def test_state_update_matches_transformers_on_scattered_rows() -> None:
    heads, head_dim, d_state, groups, num_seqs = 6, 4, 8, 3, 3
    t = make_inputs(num_seqs, heads, head_dim, d_state, groups, seed=3)
    pool = torch.randn(8, heads, head_dim, d_state)
    rows = torch.tensor([5, 0, 3])
    before = pool.clone()
    y = ssd_state_update(
        pool,
        t["x"],
        t["dt"],
        t["A"],
        t["B"],
        t["C"],
        D=t["D"],
        dt_bias=t["dt_bias"],
        state_indices=rows,
    )
    # transformers' decode expands the per-head parameters over head_dim
    hf_state = before[rows].clone()
    want = hf_bamba.mamba2_selective_state_update(
        hf_state,
        t["x"],
        t["dt"][..., None].expand(-1, -1, head_dim),
        t["A"][:, None, None].expand(-1, head_dim, d_state),
        t["B"],
        t["C"],
        t["D"][:, None].expand(-1, head_dim),
        dt_bias=t["dt_bias"][:, None].expand(-1, head_dim),
        dt_softplus=True,
    )
    assert rel_err(y, want) <= 1e-5
    assert rel_err(pool[rows], hf_state) <= 1e-5
    untouched = [i for i in range(8) if i not in rows.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


def test_low_precision_state_page_is_cast_back() -> None:
    t = make_inputs(1, 4, 8, 16, 1, seed=4)
    pool = t["state"][None].to(torch.bfloat16)
    ref = pool.float()
    y = ssd_state_update(pool, t["x"], t["dt"], t["A"], t["B"], t["C"], D=t["D"])
    want = ssd_state_update(ref, t["x"], t["dt"], t["A"], t["B"], t["C"], D=t["D"])
    assert pool.dtype == torch.bfloat16
    assert rel_err(pool.float(), ref) <= 1e-2
    assert rel_err(y, want) <= 1e-2


def test_paged_batch_equals_each_request_alone() -> None:
    """Mixed decodes and prefill chunks, fresh and carried, on a strided page view."""
    heads, head_dim, d_state, groups = 6, 4, 8, 3
    t = make_inputs(NUM_TOKENS, heads, head_dim, d_state, groups, seed=5)
    params = SSDParams(A=t["A"], D=t["D"], dt_bias=t["dt_bias"], chunk_size=8)

    def run_paged(view: Tensor, pages: Tensor, carried: list[bool], starts: list[int]) -> Tensor:
        states = StateBatch(starts, pages, carried)
        return ssd_varlen(t["x"], t["dt"], t["B"], t["C"], params, view, states)

    def run_alone(part: slice, init: Tensor | None) -> tuple[Tensor, Tensor]:
        return scan(t, part, chunk_size=8, initial_state=init)

    check_paged_batch((heads, head_dim, d_state), run_paged, run_alone)


@pytest.mark.parametrize("block_tokens", [None, 40], ids=["one_block", "blocks"])
@pytest.mark.parametrize("with_captures", [False, True], ids=["no_capture", "captures"])
@pytest.mark.parametrize("chunk_size", [8, 12, 64], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("page_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_varlen_equals_each_request_alone(
    page_dtype: torch.dtype,
    chunk_size: int,
    with_captures: bool,
    block_tokens: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ragged prefills and decodes in one call == the chunked reference per request (decodes
    == the one-step update, clamped by ``step_dt_limit``); every captured state == the final
    state of the reference run up to its row."""
    if block_tokens is not None:  # many small blocks of requests
        monkeypatch.setattr(ssd_module, "BLOCK_TOKENS", block_tokens)
    heads, head_dim, d_state, groups = 6, 4, 8, 3
    t = make_inputs(RAGGED_TOKENS, heads, head_dim, d_state, groups, seed=6)
    limit, step_limit = (0.3, 1.2), (0.0, math.inf)
    params = SSDParams(
        A=t["A"], D=t["D"], dt_bias=t["dt_bias"], chunk_size=chunk_size, dt_limit=limit,
        step_dt_limit=step_limit,
    )  # fmt: skip

    def run_varlen(view: Tensor, states: StateBatch) -> Tensor:
        return ssd_varlen(t["x"], t["dt"], t["B"], t["C"], params, view, states)

    starts = [0, *torch.tensor(RAGGED_LENS).cumsum(0).tolist()]
    decode_rows = {starts[r] for r, n in enumerate(RAGGED_LENS) if n == 1}

    def run_alone(part: slice, init: Tensor | None) -> tuple[Tensor, Tensor]:
        if part.start not in decode_rows:  # a chunk (or a capture inside one)
            return scan(t, part, chunk_size=chunk_size, dt_limit=limit, initial_state=init)
        state = (torch.zeros(heads, head_dim, d_state) if init is None else init.clone())[None]
        y = ssd_state_update(
            state, t["x"][part], t["dt"][part], t["A"], t["B"][part], t["C"][part],
            D=t["D"], dt_bias=t["dt_bias"], dt_limit=step_limit,
        )  # fmt: skip
        return y, state[0]

    check_varlen_batch((heads, head_dim, d_state), page_dtype, run_varlen, run_alone, with_captures)

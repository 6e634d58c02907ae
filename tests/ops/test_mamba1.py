"""Mamba1 selective scan against transformers' torch scan and a token-by-token recurrence.

transformers' scan always starts from zeros (its cached chunked prefill is wrong for
Mamba1), so carried-state results are checked against the unsplit full scan instead.
"""

from __future__ import annotations

import pytest
import torch
from ops_checks import NUM_TOKENS, RAGGED_TOKENS, check_paged_batch, check_varlen_batch, rel_err
from torch import Tensor

from hybridkv.ops.mamba1 import (
    SelectiveScanParams,
    selective_scan,
    selective_scan_varlen,
    selective_state_update,
)
from hybridkv.ops.mamba1 import paged as scan_module
from hybridkv.ops.paged_state import StateBatch

hf_jamba = pytest.importorskip("transformers.models.jamba.modeling_jamba")

SHAPES = [(1, 16, 4), (37, 24, 8), (130, 12, 16)]  # (seq_len, d_inner, d_state)


def make_inputs(seq_len: int, d_inner: int, d_state: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    return {
        "x": randn(seq_len, d_inner),
        "dt": randn(seq_len, d_inner) * 0.5,
        "A": -torch.exp(randn(d_inner, d_state) * 0.5 + 1.0),
        "B": randn(seq_len, d_state),
        "C": randn(seq_len, d_state),
        "D": randn(d_inner),
        "z": randn(seq_len, d_inner),
        "dt_bias": randn(d_inner) * 0.5,
        "state": randn(d_inner, d_state),
    }


def hf_scan(t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' full scan from zeros: (y [1, d_inner, T], final state [1, d_inner, N])."""
    return hf_jamba.mamba_selective_scan(
        t["x"].T[None],
        t["dt"].T[None],
        t["A"],
        t["B"].T[None],
        t["C"].T[None],
        D=t["D"],
        z=t["z"].T[None],
        delta_bias=t["dt_bias"],
        delta_softplus=True,
        return_last_state=True,
    )


def scan(
    t: dict[str, torch.Tensor], part: slice = slice(None), **kw: object
) -> tuple[torch.Tensor, torch.Tensor]:
    return selective_scan(
        t["x"][part],
        t["dt"][part],
        t["A"],
        t["B"][part],
        t["C"][part],
        D=t["D"],
        z=t["z"][part],
        dt_bias=t["dt_bias"],
        **kw,
    )


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-D{}-N{}".format(*s))
@pytest.mark.parametrize("slice_tokens", [5, 64])
def test_scan_from_zero_matches_transformers(
    shape: tuple[int, int, int], slice_tokens: int
) -> None:
    t = make_inputs(*shape)
    y, final = scan(t, slice_tokens=slice_tokens)
    want_y, want_final = hf_scan(t)
    assert rel_err(y, want_y[0].T) <= 1e-5
    assert rel_err(final, want_final[0]) <= 1e-5


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-D{}-N{}".format(*s))
def test_scan_matches_token_recurrence_from_a_state(shape: tuple[int, int, int]) -> None:
    t = make_inputs(*shape, seed=1)
    y, final = scan(t, initial_state=t["state"])
    state = t["state"].clone()[None]
    want_y = torch.cat(
        [
            selective_state_update(
                state,
                t["x"][i : i + 1],
                t["dt"][i : i + 1],
                t["A"],
                t["B"][i : i + 1],
                t["C"][i : i + 1],
                D=t["D"],
                z=t["z"][i : i + 1],
                dt_bias=t["dt_bias"],
            )
            for i in range(shape[0])
        ]
    )
    assert rel_err(y, want_y) <= 1e-5
    assert rel_err(final, state[0]) <= 1e-5


@pytest.mark.parametrize("split", [1, 7, 16, 33])
def test_split_prefill_equals_unsplit(split: int) -> None:
    t = make_inputs(50, 24, 8, seed=2)
    y1, mid = scan(t, slice(0, split))
    y2, final = scan(t, slice(split, None), initial_state=mid)
    want_y, want_final = hf_scan(t)
    assert rel_err(torch.cat([y1, y2]), want_y[0].T) <= 1e-5
    assert rel_err(final, want_final[0]) <= 1e-5


def test_state_update_matches_transformers_on_scattered_rows() -> None:
    t = make_inputs(3, 24, 8, seed=3)
    pool = torch.randn(6, 24, 8)
    rows = torch.tensor([4, 1, 2])
    before = pool.clone()
    y = selective_state_update(
        pool,
        t["x"],
        t["dt"],
        t["A"],
        t["B"],
        t["C"],
        D=t["D"],
        z=t["z"],
        dt_bias=t["dt_bias"],
        state_indices=rows,
    )
    hf_state = before[rows].clone()
    want = hf_jamba.mamba_selective_state_update(
        hf_state,
        t["x"],
        t["dt"],
        t["A"],
        t["B"],
        t["C"],
        t["D"],
        z=t["z"],
        dt_bias=t["dt_bias"],
        dt_softplus=True,
    )
    assert rel_err(y, want) <= 1e-5
    assert rel_err(pool[rows], hf_state) <= 1e-5
    assert torch.equal(pool[[0, 3, 5]], before[[0, 3, 5]])


def test_paged_batch_equals_each_request_alone() -> None:
    """Mixed decodes and prefill chunks, fresh and carried, on a strided page view."""
    t = make_inputs(NUM_TOKENS, 24, 8, seed=5)
    params = SelectiveScanParams(A=t["A"], D=t["D"], dt_bias=t["dt_bias"])

    def run_paged(view: Tensor, pages: Tensor, carried: list[bool], starts: list[int]) -> Tensor:
        states = StateBatch(starts, pages, carried)
        return selective_scan_varlen(t["x"], t["dt"], t["B"], t["C"], t["z"], params, view, states)

    check_paged_batch((24, 8), run_paged, lambda part, init: scan(t, part, initial_state=init))


@pytest.mark.parametrize("block_requests", [None, 5], ids=["one_block", "blocks"])
@pytest.mark.parametrize("with_captures", [False, True], ids=["no_capture", "captures"])
@pytest.mark.parametrize("page_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_varlen_equals_each_request_alone(
    page_dtype: torch.dtype,
    with_captures: bool,
    block_requests: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ragged prefills and decodes in one token loop == the scan per request; every captured
    state == the final state of the scan up to its row."""
    if block_requests is not None:  # requests in blocks of 5
        monkeypatch.setattr(scan_module, "BLOCK_STATE_ELEMENTS", 24 * 8 * block_requests)
    t = make_inputs(RAGGED_TOKENS, 24, 8, seed=6)
    params = SelectiveScanParams(A=t["A"], D=t["D"], dt_bias=t["dt_bias"])

    def run_varlen(view: Tensor, states: StateBatch) -> Tensor:
        return selective_scan_varlen(t["x"], t["dt"], t["B"], t["C"], t["z"], params, view, states)

    def run_alone(part: slice, init: Tensor | None) -> tuple[Tensor, Tensor]:
        return scan(t, part, initial_state=init)

    check_varlen_batch((24, 8), page_dtype, run_varlen, run_alone, with_captures)

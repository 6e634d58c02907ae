"""A varlen conv block compiled ahead of time (hybridkv.ops.causal_conv1d.packaged): the
varlen op with it == each request run alone (captures, blocks, bf16 pages), equal to the
eager form up to rounding, a row's bits independent of what shares its step, and the
eager form wherever no package serves."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from ops_checks import RAGGED_TOKENS, check_varlen_batch
from test_causal_conv1d import C, K, params
from torch import Tensor

from hybridkv.ops import ahead_of_time
from hybridkv.ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_varlen, packaged
from hybridkv.ops.causal_conv1d import paged as conv_module
from hybridkv.ops.compiled import compile_enabled, running_eagerly
from hybridkv.ops.paged_state import StateBatch

SIGNATURE = packaged.Signature(torch.float32, torch.float32, C, K, True, "cpu")


@pytest.fixture
def loaded(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The package of SIGNATURE loaded from the engine's own cache (built on the suite's
    first run on a machine), and only for the test; skipped where the suite's caller
    turned packages or compiling off."""
    if not ahead_of_time.available() or not compile_enabled():
        pytest.skip("packages compiled ahead of time are off")
    monkeypatch.setattr(packaged, "_LOADED", {})
    assert packaged.warm_up_conv(SIGNATURE)
    yield


def package_calls() -> int:
    return sum(step.num_calls for step in packaged._LOADED.values())


def rows(n: int, seed: int = 2) -> Tensor:
    return torch.randn(n, C, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("block_tokens", [None, 40], ids=["one_block", "blocks"])
@pytest.mark.parametrize("with_captures", [False, True], ids=["no_capture", "captures"])
@pytest.mark.parametrize("page_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_varlen_with_the_package_equals_each_request_alone(
    loaded: None,
    page_dtype: torch.dtype,
    with_captures: bool,
    block_tokens: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ragged NaN-poisoned step of the varlen tests through the package (blocks of one
    request and of several): every output, final state and captured state == the chunk
    reference per request."""
    if block_tokens is not None:
        monkeypatch.setattr(conv_module, "BLOCK_TOKENS", block_tokens)
    weight, _ = params(1)
    x = rows(RAGGED_TOKENS)
    calls = package_calls()

    def run_varlen(view: Tensor, states: StateBatch) -> Tensor:
        return causal_conv1d_varlen(x, view, states, weight, None, "silu")

    def run_alone(part: slice, init: Tensor | None) -> tuple[Tensor, Tensor]:
        return causal_conv1d_fn(x[part], weight, None, init, "silu")

    check_varlen_batch((C, K - 1), page_dtype, run_varlen, run_alone, with_captures)
    assert package_calls() > calls


def test_the_package_equals_the_eager_form_and_ignores_its_neighbours(loaded: None) -> None:
    """Outputs and written states against the eager form (rounding apart); a request's
    rows alone and among other requests of its block: the same bits."""
    weight, _ = params(3)
    x = rows(60, seed=4)

    def run(starts: list[int], carried: list[bool], eager: bool) -> tuple[Tensor, Tensor]:
        view = torch.randn(8, C, K - 1, generator=torch.Generator().manual_seed(5))
        states = StateBatch(starts, torch.arange(len(starts) - 1), carried)
        if eager:
            with running_eagerly():
                y = causal_conv1d_varlen(x[: starts[-1]], view, states, weight, None, "silu")
        else:
            y = causal_conv1d_varlen(x[: starts[-1]], view, states, weight, None, "silu")
        return y, view

    mixed, alone = ([0, 23, 24, 60], [True, False, True]), ([0, 23], [True])
    calls = package_calls()
    y, view = run(*mixed, eager=False)
    want_y, want_view = run(*mixed, eager=True)
    assert package_calls() == calls + 1
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(view, want_view, rtol=0, atol=0)  # copies of the inputs
    y_alone, view_alone = run(*alone, eager=False)
    assert torch.equal(y_alone, y[:23]) and torch.equal(view_alone[0], view[0])


def test_the_eager_form_runs_where_no_package_serves(loaded: None) -> None:
    """A bias, another activation, other channels, another dtype or the eager mode."""
    weight, bias = params(1)
    x = rows(5)
    assert packaged.package_for(x, weight, None, "silu") is not None
    assert packaged.package_for(x, weight, bias, "silu") is None
    assert packaged.package_for(x, weight, None, None) is None
    assert packaged.package_for(x[:, :4], weight[:4], None, "silu") is None
    assert packaged.package_for(x.bfloat16(), weight, None, "silu") is None
    with running_eagerly():
        assert packaged.package_for(x, weight, None, "silu") is None

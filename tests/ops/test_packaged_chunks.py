"""The chunked gated delta rule's operands compiled ahead of time
(hybridkv.ops.gated_delta_rule.packaged_chunks): equal to the eager operands up to
rounding, a chunk's bits independent of the other chunks of its step, the varlen op with
the package equal to each request run alone (captures included), and the eager form
wherever no package serves."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from ops_checks import RAGGED_TOKENS, check_varlen_batch
from test_gated_delta_rule import make_inputs, reference_per_request
from torch import Tensor

from hybridkv.ops import ahead_of_time
from hybridkv.ops.compiled import compile_enabled, running_eagerly
from hybridkv.ops.gated_delta_rule import chunk_gated_delta_rule, gated_delta_rule_varlen
from hybridkv.ops.gated_delta_rule import packaged_chunks as packaged
from hybridkv.ops.gated_delta_rule.chunk_operands import chunk_operands, prepare_rows
from hybridkv.ops.paged_state import StateBatch

SHAPES = (2, 16, 4, 12)  # Hk, Dk, Hv, Dv: make_inputs' defaults


def signature(dtype: torch.dtype) -> packaged.Signature:
    return packaged.Signature((dtype, dtype, dtype, torch.float32, dtype), *SHAPES, "cpu")


@pytest.fixture
def loaded(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The packages of SHAPES in fp32 and bf16 loaded, from the engine's own cache (built
    on the suite's first run on a machine), and only for the test: later tests of these
    shapes keep the eager form. Skipped where the suite's caller turned packages or
    compiling off."""
    if not ahead_of_time.available() or not compile_enabled():
        pytest.skip("packages compiled ahead of time are off")
    monkeypatch.setattr(packaged, "_LOADED", {})
    for dtype in (torch.float32, torch.bfloat16):
        assert packaged.warm_up_chunks(signature(dtype))
    yield


def rows_of(n: int, dtype: torch.dtype) -> tuple[Tensor, ...]:
    q, k, v, g, beta, _ = (t[0] for t in make_inputs(n))
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype)


def package_calls() -> int:
    return sum(step.num_calls for step in packaged._LOADED.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_packaged_operands_equal_the_eager_ones(loaded: None, dtype: torch.dtype) -> None:
    """Every operand of a ragged step's chunks (prefills of 2-40 rows beside decodes, some
    sharing chunk steps): the package against the eager preparation, padding and
    operands, to fp32 rounding."""
    lens = [1, 40, 2, 17, 1, 33]
    rows = rows_of(sum(lens), dtype)
    fused = torch.cat([t.flatten(1) for t in rows[:3]], dim=1)  # [T, q | k | v], as the
    parts = fused.split([t[0].numel() for t in rows[:3]], dim=1)  # layer passes them
    q, k, v = (p.unflatten(1, t.shape[1:]) for p, t in zip(parts, rows, strict=False))
    assert not v.is_contiguous()
    rows = (q, k, v, *rows[3:])
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    states = StateBatch(starts, torch.arange(len(lens)), [True] * len(lens))
    (layout,) = states.chunks(16, 512)
    step = packaged.package_for(rows, layout)
    assert step is not None
    got = packaged.run_package(step, packaged.contiguous_rows(rows), layout)
    want = chunk_operands(*layout.pad_heads_first(prepare_rows(*rows)), layout.strict_upper)
    for name, g, w in zip(want._fields, got, want, strict=True):
        assert g.shape == w.shape, name
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=name)


def test_a_chunks_operands_do_not_depend_on_the_step(loaded: None) -> None:
    """A request's chunks alone and among other requests' chunks (another layout, other
    chunk numbers): the same bits, so caching on and off, which put a prompt in different
    steps, compute it alike."""
    dtype = torch.bfloat16
    rows = rows_of(70, dtype)
    alone = StateBatch([0, 40], torch.arange(1), [True])
    mixed = StateBatch([0, 40, 45, 70], torch.arange(3), [True] * 3)
    (alone_layout,) = alone.chunks(16, 512)
    (mixed_layout,) = mixed.chunks(16, 512)
    for layout in (alone_layout, mixed_layout):
        assert packaged.package_for(rows, layout) is not None
    step, packed = packaged._LOADED[signature(dtype)], packaged.contiguous_rows(rows)
    only = packaged.run_package(step, packed, alone_layout)
    among = packaged.run_package(step, packed, mixed_layout)
    # the first request of the mixed layout is the longest: chunk i at step i, first
    position = [first for first, _ in mixed_layout.steps]
    for a, b in zip(only, among, strict=True):
        assert torch.equal(a, b[position]), a.shape


@pytest.mark.parametrize("with_captures", [False, True], ids=["no_capture", "captures"])
@pytest.mark.parametrize("page_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_varlen_with_the_package_equals_each_request_alone(
    loaded: None, page_dtype: torch.dtype, with_captures: bool
) -> None:
    """The varlen op whose operands come from the package, on the ragged NaN-poisoned step
    of the varlen tests: every output, final state and captured state (inside and at the
    end of chunks) == the chunked reference per request."""
    q, k, v, g, beta, _ = (t[0] for t in make_inputs(RAGGED_TOKENS))
    calls = package_calls()

    def run_varlen(view: Tensor, states: StateBatch) -> Tensor:
        return gated_delta_rule_varlen(q, k, v, g, beta, view, states, 16)

    run_alone = reference_per_request(chunk_gated_delta_rule, q, k, v, g, beta)
    check_varlen_batch((4, 16, 12), page_dtype, run_varlen, run_alone, with_captures)
    assert package_calls() > calls


def test_the_eager_form_runs_where_no_package_serves(loaded: None) -> None:
    """No package for other shapes or chunk lengths, nor in eager mode."""
    rows = rows_of(40, torch.float32)
    states = StateBatch([0, 40], torch.arange(1), [True])
    (layout,) = states.chunks(16, 512)
    assert packaged.package_for(rows, layout) is not None
    with running_eagerly():
        assert packaged.package_for(rows, layout) is None
    (other,) = states.chunks(64, 512)
    assert packaged.package_for(rows, other) is None
    wider = (rows[0], rows[1], torch.cat([rows[2], rows[2]], dim=-1), rows[3], rows[4])
    assert packaged.package_for(wider, layout) is None


@pytest.mark.parametrize("starts", [[0, 12], [0, 16], [0, 2], [0, 1, 13, 14], [0, 1, 2, 3, 20]])
def test_one_or_two_chunks_take_the_package(loaded: None, starts: list[int]) -> None:
    """A layout of one chunk (a prompt tail, a short prompt beside decodes) or two: sizes
    export may treat apart (its example had three chunks); served and equal to eager."""
    rows = rows_of(starts[-1], torch.float32)
    states = StateBatch(starts, torch.arange(len(starts) - 1), [True] * (len(starts) - 1))
    (layout,) = states.chunks(16, 512)
    assert layout.num_chunks <= 2
    step = packaged.package_for(rows, layout)
    assert step is not None
    got = packaged.run_package(step, packaged.contiguous_rows(rows), layout)
    want = chunk_operands(*layout.pad_heads_first(prepare_rows(*rows)), layout.strict_upper)
    for name, g, w in zip(want._fields, got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=name)


def test_strided_rows_are_refused(loaded: None) -> None:
    """A package reads its inputs as contiguous (strided views gave wrong operands), so
    run_package refuses rows that are not."""
    q, k, v, g, beta = rows_of(40, torch.float32)
    (layout,) = StateBatch([0, 40], torch.arange(1), [True]).chunks(16, 512)
    step = packaged.package_for((q, k, v, g, beta), layout)
    assert step is not None
    with pytest.raises(ValueError, match="contiguous"):
        packaged.run_package(step, (q, k, v[:, :, :], g.T.contiguous().T, beta), layout)

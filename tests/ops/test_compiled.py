"""CompiledOp: compiled on first use; eager inside running_eagerly(), under autograd, or
once compiling failed (a warning, once)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor
from torch._inductor.exc import InductorError

from hybridkv.ops import compiled as compiled_module
from hybridkv.ops.compiled import CompiledOp, compile_enabled, running_eagerly


def scaled_sum(x: Tensor, scale: Tensor) -> Tensor:
    return (x * scale).sum(-1)


@pytest.fixture
def compile_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Records torch.compile calls; the "compiled" function runs eagerly, tagged."""
    calls: list[str] = []

    def fake_compile(fn: Callable[..., Tensor], **kwargs: object) -> Callable[..., Tensor]:
        calls.append(fn.__name__)

        def run(*args: Tensor) -> Tensor:
            calls.append("compiled run")
            return fn(*args)

        return run

    monkeypatch.setattr(compiled_module.torch, "compile", fake_compile)
    yield calls


def test_an_op_compiles_once_and_runs_compiled(compile_calls: list[str]) -> None:
    op = CompiledOp(scaled_sum)
    x, s = torch.randn(3, 4), torch.randn(4)
    for _ in range(2):
        assert torch.equal(op(x, s), scaled_sum(x, s))
    assert compile_calls == ["scaled_sum", "compiled run", "compiled run"]


def scaled_sum_eager(x: Tensor, scale: Tensor) -> Tensor:
    return x @ scale


def test_inside_running_eagerly_an_op_runs_its_eager_form(compile_calls: list[str]) -> None:
    assert compile_enabled()
    op = CompiledOp(scaled_sum, scaled_sum_eager)
    x, s = torch.randn(3, 4), torch.randn(4)
    with running_eagerly():
        assert not compile_enabled()
        assert torch.equal(op(x, s), scaled_sum_eager(x, s))
    assert compile_enabled() and compile_calls == []
    assert torch.equal(op(x, s), scaled_sum(x, s))
    assert compile_calls == ["scaled_sum", "compiled run"]  # the fused form compiled


def test_inputs_that_autograd_tracks_run_eagerly(compile_calls: list[str]) -> None:
    op = CompiledOp(scaled_sum)
    x = torch.randn(2, 3, requires_grad=True)
    op(x, torch.ones(3)).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.ones(2, 3))
    with torch.no_grad():
        op(x, torch.ones(3))  # nothing recorded: compiled
    assert compile_calls == ["scaled_sum", "compiled run"]


def test_a_failed_compile_warns_once_and_runs_eagerly_from_then_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    attempts: list[int] = []

    def failing_compile(fn: Callable[..., Tensor], **kwargs: object) -> Callable[..., Tensor]:
        def run(*args: Tensor) -> Tensor:
            attempts.append(1)
            raise InductorError(RuntimeError("no working C++ compiler"), None)

        return run

    monkeypatch.setattr(compiled_module.torch, "compile", failing_compile)
    op = CompiledOp(scaled_sum, scaled_sum_eager)
    x, s = torch.randn(3, 4), torch.randn(4)
    with caplog.at_level(logging.WARNING, logger=compiled_module.__name__):
        assert torch.equal(op(x, s), scaled_sum_eager(x, s))
        assert torch.equal(op(x, s), scaled_sum_eager(x, s))
    assert attempts == [1]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "scaled_sum" in warnings[0] and "eagerly" in warnings[0]


def test_an_error_that_is_not_a_compile_failure_propagates(
    compile_calls: list[str],
) -> None:
    op = CompiledOp(scaled_sum)
    with pytest.raises(RuntimeError, match="size"):
        op(torch.randn(3, 4), torch.randn(5))

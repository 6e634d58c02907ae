"""CompiledOp: compiled on first use; eager inside running_eagerly(), under autograd, or
once compiling failed (a warning, once)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor
from torch._dynamo.exc import FailOnRecompileLimitHit
from torch._inductor.exc import InductorError

from hybridkv.ops import compiled as compiled_module
from hybridkv.ops.compiled import CompiledOp, compile_enabled, running_eagerly


def scaled_sum(x: Tensor, scale: Tensor) -> Tensor:
    """The "fused" form of the ops under test."""
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
    """Their eager form: the same values (up to rounding), another computation."""
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


def test_a_compiler_that_cannot_be_imported_means_eager_ops(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Dynamo and inductor are imported on the first compile (hybridkv.ops.compiled
    ._failures), not with hybridkv: an install where that import fails gets the eager
    form, with one warning, as for a compile that fails."""

    def broken() -> None:
        raise ImportError("cannot import name 'config' from 'torch._inductor'")

    monkeypatch.setattr(compiled_module, "_failures", broken)
    op = CompiledOp(scaled_sum, scaled_sum_eager)
    x, s = torch.randn(3, 4), torch.randn(4)
    with caplog.at_level(logging.WARNING, logger=compiled_module.__name__):
        assert torch.equal(op(x, s), scaled_sum_eager(x, s))
        assert torch.equal(op(x, s), scaled_sum_eager(x, s))
    assert not op.will_compile() and op.num_compiled_calls == 0
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "cannot import" in warnings[0]


def test_an_error_that_is_not_a_compile_failure_propagates(
    compile_calls: list[str],
) -> None:
    op = CompiledOp(scaled_sum)
    with pytest.raises(RuntimeError, match="size"):
        op(torch.randn(3, 4), torch.randn(5))


def test_a_call_past_the_recompile_limit_runs_eagerly_for_those_inputs_only(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Dynamo refuses one more graph (its recompile limit): that combination of dtypes runs
    the eager form from then on, without asking dynamo again; the others stay compiled."""
    attempts: list[torch.dtype] = []

    def limited_compile(fn: Callable[..., Tensor], **kwargs: object) -> Callable[..., Tensor]:
        def run(x: Tensor, scale: Tensor) -> Tensor:
            attempts.append(x.dtype)
            if x.dtype == torch.float64:
                raise FailOnRecompileLimitHit("recompile limit reached")
            return fn(x, scale)

        return run

    monkeypatch.setattr(compiled_module.torch, "compile", limited_compile)
    op = CompiledOp(scaled_sum, scaled_sum_eager)
    x, s = torch.randn(3, 4), torch.randn(4)
    with caplog.at_level(logging.WARNING, logger=compiled_module.__name__):
        for _ in range(2):
            assert torch.equal(op(x.double(), s.double()), scaled_sum_eager(x.double(), s.double()))
            assert torch.equal(op(x, s), scaled_sum(x, s))
    assert attempts == [torch.float64, torch.float32, torch.float32]
    assert op.num_compiled_calls == 2 and op.will_compile()
    assert len(caplog.records) == 1 and "runs eagerly for inputs" in caplog.records[0].getMessage()


def test_a_platform_torch_compile_refuses_runs_eagerly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """torch.compile raising at once (an unsupported Python or platform) is a failed
    compile too: one warning, the eager form from then on."""
    calls: list[int] = []

    def refusing_compile(fn: Callable[..., Tensor], **kwargs: object) -> Callable[..., Tensor]:
        calls.append(1)
        raise RuntimeError("torch.compile is not supported on this Python")

    monkeypatch.setattr(compiled_module.torch, "compile", refusing_compile)
    op = CompiledOp(scaled_sum, scaled_sum_eager)
    x, s = torch.randn(3, 4), torch.randn(4)
    with caplog.at_level(logging.WARNING, logger=compiled_module.__name__):
        assert torch.equal(op(x, s), scaled_sum_eager(x, s))
        assert torch.equal(op(x, s), scaled_sum_eager(x, s))
    assert calls == [1] and not op.will_compile() and len(caplog.records) == 1


@pytest.mark.parametrize("chosen", [None, True, False], ids=lambda c: f"user_{c}")
def test_ops_compile_trusting_the_cpu_flags_unless_the_user_chose(
    chosen: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every op compiles with ``cpp.vec_isa_ok`` (inductor's dry-compile probe of each
    vector ISA skipped: ~1 s of start-up), unless ``TORCHINDUCTOR_VEC_ISA_OK`` set it."""
    from torch._inductor import config as inductor_config

    seen: list[object] = []

    def fake_compile(fn: Callable[..., Tensor], **kwargs: object) -> Callable[..., Tensor]:
        seen.append(kwargs.get("options"))
        return fn

    monkeypatch.setattr(compiled_module.torch, "compile", fake_compile)
    with inductor_config.patch({"cpp.vec_isa_ok": chosen}):
        CompiledOp(scaled_sum)(torch.randn(3, 4), torch.randn(4))
    assert seen == [{"cpp.vec_isa_ok": True} if chosen is None else {}]

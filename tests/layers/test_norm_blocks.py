"""Norms over blocks of rows (``by_row_blocks``) give the bits of one call on all rows."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from hybridkv.layers.mamba2 import GroupedGatedRMSNorm
from hybridkv.layers.norm import GatedRMSNorm, RMSNorm, ZeroCenteredRMSNorm
from hybridkv.models.falcon_h1 import FalconGatedRMSNorm
from hybridkv.models.nemotron_h import Fp32RMSNorm
from hybridkv.ops import row_blocks
from hybridkv.ops.row_blocks import by_row_blocks

WIDTH = 24


def _norms() -> dict[str, tuple[nn.Module, bool]]:
    """name -> (module with non-trivial weights, whether it takes a gate)."""
    modules = {
        "rms": (RMSNorm(WIDTH), False),
        "zero-centred": (ZeroCenteredRMSNorm(WIDTH), False),
        "gated": (GatedRMSNorm(WIDTH), True),
        "grouped-gated": (GroupedGatedRMSNorm(WIDTH, group_size=8, eps=1e-6), True),
        "fp32-weight": (Fp32RMSNorm(WIDTH, eps=1e-6), False),
        "falcon-gated": (FalconGatedRMSNorm(WIDTH, 8, 1e-6, norm_before_gate=True), True),
        "falcon-gate-first": (FalconGatedRMSNorm(WIDTH, 8, 1e-6, norm_before_gate=False), True),
    }
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module, _ in modules.values():
            module.weight.copy_(torch.randn(WIDTH, generator=gen) * 0.2 + 1.0)
    return modules


@pytest.mark.parametrize("name", list(_norms()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(485, WIDTH), (485, 3, WIDTH)])
def test_blocked_norm_equals_one_call(
    name: str, dtype: torch.dtype, shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """485 rows in blocks of 64 (the last one of 37) == all rows at once, bit for bit, on
    one thread (as the benchmarks run). With more threads ATen splits an elementwise op
    at a point that depends on its size, and the elements in each part's scalar tail (silu's
    exp) may round differently: then no two step sizes agree bitwise, blocked or not."""
    module, gated = _norms()[name]
    module = module.to(dtype)
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    gate = torch.randn(shape, generator=gen).to(dtype)
    args = (x, gate) if gated else (x,)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _check_blocks(module, args, monkeypatch)
    finally:
        torch.set_num_threads(threads)


def _check_blocks(
    module: nn.Module, args: tuple[Tensor, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    x = args[0]
    with torch.no_grad():
        whole = module(*args)  # 485 rows fit one block at the default size
        calls: list[int] = []

        def counting(norm: Callable[..., Tensor], *tensors: Tensor) -> Tensor:
            calls.append(tensors[0].shape[0])
            return norm(*tensors)

        per_row = x[0].numel()
        monkeypatch.setattr(row_blocks, "ROW_BLOCK_ELEMENTS", 64 * per_row * len(args))
        blocked = module(*args)
        assert blocked.dtype == whole.dtype and blocked.shape == whole.shape
        assert torch.equal(blocked, whole)
        # the blocks really are blocks: 8 of them, the last of 37 rows
        seen = by_row_blocks(lambda *t: counting(module, *t), *args)
        assert calls == [64] * 7 + [37]
        assert torch.equal(seen, whole)


@pytest.mark.parametrize("tracked", ["input", "weight"])
def test_grad_mode_keeps_one_call(tracked: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With grad mode on the norm runs once on all rows (regression: a trainable weight
    with an untracked input went through the blocks), and its gradient flows."""
    module = RMSNorm(WIDTH)
    monkeypatch.setattr(row_blocks, "ROW_BLOCK_ELEMENTS", 64 * WIDTH)
    x = torch.randn(485, WIDTH, requires_grad=tracked == "input")
    calls: list[int] = []
    out = by_row_blocks(lambda rows: calls.append(rows.shape[0]) or module(rows), x)
    out.sum().backward()
    assert calls == [485]
    grad = x.grad if tracked == "input" else module.weight.grad
    assert grad is not None and torch.isfinite(grad).all()

"""fp32 linears of a compiled graph through oneDNN (hybridkv.ops.onednn_linear): the mode
records them as oneDNN calls and changes no product, a package taking its weights as
inputs compiles them to oneDNN calls and equals the eager linears whatever weights it is
given, and inductor's own lowerings are back after a build."""

from __future__ import annotations

import sys
import zipfile

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from hybridkv.ops import ahead_of_time, onednn_linear

pytestmark = pytest.mark.skipif(
    not onednn_linear.available(), reason="this torch has no oneDNN pointwise linear"
)
ONEDNN = torch.ops.mkldnn._linear_pointwise


def layers(x: Tensor, w_in: Tensor, b_in: Tensor, w_out: Tensor) -> Tensor:
    """A projection with a bias, a SiLU, a projection without, and a residual add (what
    inductor's fusion pass folds into the linear): an MLP block's shape."""
    hidden = F.silu(F.linear(x, w_in, b_in))
    return x + F.linear(hidden, w_out)


class Layers(torch.nn.Module):
    def forward(self, x: Tensor, w_in: Tensor, b_in: Tensor, w_out: Tensor) -> Tensor:
        with onednn_linear.linears_through_onednn():
            return layers(x, w_in, b_in, w_out)


def weights(seed: int, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    w_in = torch.randn(96, 64, generator=g) * 0.1
    b_in = torch.randn(96, generator=g) * 0.1
    w_out = torch.randn(64, 96, generator=g) * 0.1
    return w_in.to(dtype), b_in.to(dtype), w_out.to(dtype)


def targets(x: Tensor, *ws: Tensor) -> list[object]:
    program = torch.export.export(Layers(), (x, *ws))
    return [n.target for n in program.graph.nodes if n.op == "call_function"]


def test_the_mode_records_fp32_cpu_linears_as_onednn_calls_and_nothing_else() -> None:
    x = torch.randn(5, 64)
    recorded = targets(x, *weights(0))
    assert recorded.count(ONEDNN.default) == 2
    assert torch.ops.aten.linear.default not in recorded
    # bf16: the BLAS's linears as they were (oneDNN's bf16 path is another matter)
    bf16 = targets(x.bfloat16(), *weights(0, torch.bfloat16))
    assert ONEDNN.default not in bf16
    assert bf16.count(torch.ops.aten.linear.default) == 2


@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 64)])
def test_the_mode_changes_no_product(shape: tuple[int, ...]) -> None:
    x = torch.randn(*shape)
    ws = weights(1)
    with torch.no_grad():
        torch.testing.assert_close(Layers()(x, *ws), layers(x, *ws), rtol=1e-5, atol=1e-6)


def test_a_package_takes_its_weights_as_inputs_and_calls_onednn() -> None:
    """Built once per machine in the engine's cache, as a graph's package is; run on
    weights other than the ones it was exported with, and on other row counts."""
    if ahead_of_time.cache_dir() is None or not ahead_of_time.available():
        pytest.skip("packages are off here")
    example = (torch.randn(6, 64), *weights(2))
    rows = torch.export.Dim("rows", min=2)
    flat = list(example)
    key = ahead_of_time.package_key(
        "test-onednn-linears", (sys.modules[__name__], onednn_linear), flat, [True, *[False] * 3]
    )

    def export() -> torch.export.ExportedProgram:
        return torch.export.export(Layers(), example, dynamic_shapes=({0: rows}, None, None, None))

    step = ahead_of_time.load_or_build(key, export)
    assert step is not None
    for num_rows, seed in [(6, 3), (37, 4), (1, 5)]:
        x, ws = torch.randn(num_rows, 64), weights(seed)
        torch.testing.assert_close(step(x, *ws)[0], layers(x, *ws), rtol=1e-5, atol=1e-6)
    with zipfile.ZipFile(step.path) as package:
        code = b"".join(package.read(n) for n in package.namelist() if n.endswith(".cpp"))
    assert b"aoti_torch_cpu__linear_pointwise(" in code  # the unary linear
    assert b"aoti_torch_cpu__linear_pointwise_binary(" in code  # the one with the add folded


def test_inductors_own_lowerings_are_back_after_a_build() -> None:
    from torch._inductor import lowering, mkldnn_lowerings  # noqa: F401

    stock = {op: lowering.lowerings.get(op) for op in (ONEDNN.default, ONEDNN.binary)}
    with onednn_linear.input_weight_lowering():
        assert all(lowering.lowerings.get(op) is not f for op, f in stock.items())
    assert {op: lowering.lowerings.get(op) for op in stock} == stock


def test_a_failed_build_puts_them_back_too() -> None:
    from torch._inductor import lowering

    stock = lowering.lowerings.get(ONEDNN.default)
    with pytest.raises(RuntimeError), onednn_linear.input_weight_lowering():
        raise RuntimeError("the compile failed")
    assert lowering.lowerings.get(ONEDNN.default) is stock

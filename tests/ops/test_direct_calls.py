"""Compiled graphs called directly (hybridkv.ops.direct_calls): only for the arguments
dynamo ran them for (same long-lived tensors, batch tensors of one layout, same modes), and
then with the bits dynamo's own call gives."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import torch
from test_gdn_mixer_decode import decode, group_pages, projections, weights
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from hybridkv.ops.compiled import CompiledOp
from hybridkv.ops.direct_calls import _layout
from hybridkv.ops.gated_delta_rule import mixer_decode as fused

MixerOp = CompiledOp[..., tuple[Tensor, ...]]


def test_the_views_a_graph_ran_for_take_it_directly_with_dynamos_bits(
    fresh_compile: MixerOp,
) -> None:
    """After the warm-up (dynamo's call) the same page views run the graph directly at any
    batch size; the outputs and every byte of the arena equal a call through dynamo."""
    dtype = torch.bfloat16
    arena, conv, ssm = group_pages(24, dtype)
    w = weights(dtype)
    fused.warm_up_mixer_decode(conv, ssm, w)
    assert fresh_compile.direct.num_direct_calls == 0
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for batch, fresh in ((1, [True]), (5, [False, True, False, False, True]), (17, None)):
        rows, pages = list(range(1, batch + 1)), list(range(3, 3 + batch))
        inputs = projections(batch + 2, dtype, seed=batch)
        before = arena.clone()
        direct = decode(inputs, rows, pages, fresh, conv, ssm, w)
        direct_arena = arena.clone()
        assert fresh_compile.direct.num_direct_calls == 1
        arena.copy_(before)
        fresh_compile.direct.clear()  # forget it: this call goes through dynamo
        through_dynamo = decode(inputs, rows, pages, fresh, conv, ssm, w)
        assert fresh_compile.direct.num_direct_calls == 0
        assert torch.equal(direct, through_dynamo) and torch.equal(arena, direct_arena)
        assert not torch.equal(arena, before)  # the states were written
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_other_views_and_other_modes_go_through_dynamo_first(fresh_compile: MixerOp) -> None:
    """Views the graph has not run for (another arena of the same layout) and a call
    outside inference mode take dynamo's path, which learns them; their next call is
    direct."""
    dtype = torch.bfloat16
    w = weights(dtype)
    _, conv, ssm = group_pages(12, dtype, seed=3)
    _, other_conv, other_ssm = group_pages(12, dtype, seed=4)
    inputs = projections(4, dtype)
    decode(inputs, [0, 1, 2], [4, 5, 6], None, conv, ssm, w)  # learns conv, ssm
    direct = fresh_compile.direct
    decode(inputs, [0, 1, 2], [4, 5, 6], None, other_conv, other_ssm, w)
    assert direct.num_direct_calls == 0
    decode(inputs, [0, 1], [1, 2], None, other_conv, other_ssm, w)
    decode(inputs, [0, 1], [1, 2], None, conv, ssm, w)
    assert direct.num_direct_calls == 2
    with torch.no_grad():  # not inference mode: other tensors, another guard
        decodes = fused.DecodeRows(torch.tensor([0, 1]), torch.tensor([7, 8]), None)
        fused.gated_deltanet_decode(*(t.clone() for t in inputs), decodes, conv, ssm, w)
    assert direct.num_direct_calls == 2


def test_a_direct_call_is_forgotten_with_its_views(fresh_compile: MixerOp) -> None:
    """The direct calls hold the long-lived tensors weakly: freed views take theirs along."""
    dtype = torch.bfloat16
    w = weights(dtype)
    arena, conv, ssm = group_pages(12, dtype)
    decode(projections(3, dtype), [0, 1], [2, 3], None, conv, ssm, w)
    learnt = len(fresh_compile.direct._calls)
    assert learnt >= 1
    del arena, conv, ssm
    gc.collect()
    assert len(fresh_compile.direct._calls) < learnt


def marked(*sizes: int) -> list[Tensor]:
    tensors = [torch.zeros(n, 3) for n in sizes]
    for t in tensors:
        torch._dynamo.decorators.mark_unbacked(t, 0)
    return tensors


def test_arguments_are_told_apart_by_long_lived_tensors_and_batch_layouts() -> None:
    """The key: long-lived tensors by identity, batch tensors (marked unbacked at dim 0) by
    layout with one first size; batch tensors of two sizes, nested containers or no batch
    tensor at all give no key (dynamo's path)."""
    held = torch.zeros(4)
    a, b = marked(5, 5)
    layout = _layout((a, (held, b), 2.0))
    assert layout is not None
    assert layout[0] == (held,) and layout[2] == 5
    other_a, other_b = marked(7, 7)
    again = _layout((other_a, (held, other_b), 2.0))
    assert again is not None and again[1] == layout[1]  # another batch size, same key
    assert _layout((other_a, (held, b), 2.0)) is None  # first sizes 7 and 5
    assert _layout((a, (held, b), 3.0))[1] != layout[1]  # type: ignore[index]
    assert _layout((a, [held], 2.0)) is None
    assert _layout((held, 2.0)) is None
    (wide,) = marked(5)
    assert _layout((a, (held, wide.double()), 2.0)) is not None
    assert _layout((a, (held, wide.double()), 2.0))[1] != layout[1]  # type: ignore[index]


SCALE = torch.tensor(3.0)  # a global the toy functions read (never changes)


def batch(rows: int, seed: int = 0) -> Tensor:
    x = torch.randn(rows, 6, generator=torch.Generator().manual_seed(seed))
    torch._dynamo.decorators.mark_unbacked(x, 0)
    return x


def check(op: CompiledOp[..., Any], fn: Callable[..., Any], *args: Any) -> bool:
    """Run ``op``: its result must be ``fn``'s (values and dtypes); whether it was direct."""
    before = op.direct.num_direct_calls
    got, want = op(*args), fn(*args)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, equal_nan=True)
    return op.direct.num_direct_calls > before


def scaled_pair(x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    return x * weight * SCALE, (x + weight).sum(-1)


def returns_its_input(x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    return x * weight, weight


def test_a_global_is_a_constant_input_and_a_returned_input_keeps_dynamos_path() -> None:
    """A global tensor the function reads is a constant input of its direct call; a result
    that is not one of the graph's outputs (an input returned as it is) keeps every call
    on dynamo's path. Keyword arguments always take it."""
    weight = torch.randn(6)
    for fn, direct in ((scaled_pair, [False, True, True]), (returns_its_input, [False] * 3)):
        op = CompiledOp(fn)
        with torch.inference_mode():
            assert [check(op, fn, batch(n), weight) for n in (3, 1, 4)] == direct
            assert op(batch(2), weight=weight)[0].shape == (2, 6)
        assert op.num_compiled_calls == 4 and op.direct.num_direct_calls == sum(direct)


def scale_by(x: Tensor, weight: Tensor, c: object) -> Tensor:
    return x * weight / c  # type: ignore[operator]


def test_plain_values_match_by_type_and_sign() -> None:
    """2 and 2.0, 0.0 and -0.0 are different arguments (dynamo's graphs differ: an int or a
    float result, +inf or -inf)."""
    op, weight = CompiledOp(scale_by), torch.randn(6)
    with torch.no_grad():
        calls = [(3, 2), (4, 2), (3, 2.0), (3, 0.0), (2, -0.0), (3, -0.0), (5, 0.0)]
        direct = [check(op, scale_by, batch(n), weight, c) for n, c in calls]
    assert direct == [False, True, False, False, False, True, True]


def add_scaled(x: Tensor, y: Tensor, weight: Tensor) -> Tensor:
    return x + y * weight


def test_a_batch_tensor_passed_twice_is_not_two_tensors() -> None:
    """Dynamo gives one graph input to a tensor passed twice; two different tensors later
    take dynamo's path (another graph), not that one."""
    op, weight = CompiledOp(add_scaled), torch.randn(6)
    x = batch(3)
    with torch.no_grad():
        direct = [
            check(op, add_scaled, x, x, weight),
            check(op, add_scaled, batch(4, 1), batch(4, 2), weight),
            check(op, add_scaled, batch(2, 1), batch(2, 2), weight),
        ]
    assert direct == [False, False, True]


def either_order(x: Tensor, a: object, b: object) -> Tensor:
    weight, flag = (a, b) if isinstance(a, Tensor) else (b, a)
    return x * weight if flag else x - weight  # type: ignore[operator]


class Config:
    def __init__(self, k: float) -> None:
        self.k = k


def times_k(x: Tensor, config: Config) -> Tensor:
    return x * config.k


def test_arguments_in_other_places_or_objects_take_dynamos_path() -> None:
    """Tensors and values in other positions are other arguments; an object argument (its
    attributes could change) never runs directly."""
    op, weight = CompiledOp(either_order), torch.randn(6)
    with torch.no_grad():
        assert not check(op, either_order, batch(3), weight, False)
        assert not check(op, either_order, batch(3), False, weight)
        assert check(op, either_order, batch(2), False, weight)
        config, by_k = Config(2.0), CompiledOp(times_k)
        assert not check(by_k, times_k, batch(3), config)
        config.k = 50.0
        assert not check(by_k, times_k, batch(3), config)


def test_a_changed_weight_mode_or_global_state_takes_dynamos_path() -> None:
    """A long-lived tensor cast in place (``.data``), dynamo told to run eagerly, and
    another grad mode each send the call through dynamo; under a dispatch mode (which
    dynamo refuses) the op runs its eager form, every op seen by the mode."""
    op, weight = CompiledOp(scaled_pair), torch.randn(6)
    with torch.no_grad():
        assert [check(op, scaled_pair, batch(n), weight) for n in (3, 4)] == [False, True]
        weight.data = weight.data.double()
        assert not check(op, scaled_pair, batch(4).double(), weight)
        weight.data = weight.data.float()
        check(op, scaled_pair, batch(4), weight)  # (back to fp32, at a new address)
        assert check(op, scaled_pair, batch(5), weight)

        class Counting(TorchDispatchMode):
            ops = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                Counting.ops += 1
                return func(*args, **(kwargs or {}))

        with Counting():
            assert not check(op, scaled_pair, batch(4), weight)
        assert Counting.ops > 0
        with torch.compiler.set_stance("force_eager"):
            assert not check(op, scaled_pair, batch(4), weight)
    with torch.enable_grad():  # the grad mode is in dynamo's global state guard
        assert not check(op, scaled_pair, batch(4), weight)


def bump(x: Tensor, weight: Tensor) -> Tensor:
    x.add_(weight)
    return x * 2


def test_a_graph_that_writes_a_batch_tensor_is_not_learnt_and_batches_are_not_kept() -> None:
    op, weight = CompiledOp(bump), torch.randn(6)
    with torch.no_grad():
        for n in (3, 4):
            x = batch(n)
            want = (x + weight) * 2
            torch.testing.assert_close(op(x, weight), want)
        assert op.direct.num_direct_calls == 0
        learnt = CompiledOp(scaled_pair)
        for n in (3, 4):
            x = batch(n)
            learnt(x, weight)
        gone = weakref.ref(x)
        del x
        gc.collect()
    assert learnt.direct.num_direct_calls == 1 and gone() is None

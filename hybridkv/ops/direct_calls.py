"""Calling a compiled op's graph directly, without dynamo's dispatch on every call.

Each call of a ``torch.compile``d function first runs dynamo's frame machinery: find the
cache entry, check its guards, run the bytecode that unpacks the arguments into the
graph's inputs and packs its outputs into the result. Warm, that costs ~12 us more than
the graph's own call; in a serving step it is never warm: between two GDN layers a layer's
weights stream through the caches, and the same machinery then costs ~75 us more (a
two-op graph after 64 MB streamed: 116 us through dynamo, 40 us called directly, one
thread). The GDN mixer's decode step (:mod:`hybridkv.ops.gated_delta_rule.mixer_decode`)
is such a call in every GDN layer of every step; called directly, a decode step of the
small Qwen3-Next took 8.6% less at 8 requests and 6.6% less at 64 (in-process A/B,
benchmarks/README.md).

:class:`DirectCalls` learns, the first time dynamo runs a graph for some arguments, how the
graph's inputs come from them and how its outputs make the result, and calls the graph
itself when the same arguments come again:

- each tensor input is an argument or a field of a tuple argument (found by identity), or
  else a constant the function reads from its globals or defaults;
- each size input is the batch size when unbacked (the tensors marked with
  ``torch._dynamo.decorators.mark_unbacked``, at dim 0 only, all of one size), and
  otherwise fixed by the arguments below, so the value dynamo passed then;
- the result is the graph's outputs (each element of a tuple result one of them).

"The same arguments" is strict: the same long-lived tensor objects (page views, weights:
every argument tensor not marked unbacked, held weakly, with the same dtype and address),
batch tensors of the same dtype, device, trailing sizes and strides with one first size
and repeated where they were, plain values (None, bool, int, float, str) of the same type
and value, no other objects, no keyword arguments, dynamo's global state (grad mode,
autocast, default dtype, ...) and the inference mode as they were, no torch-function or
dispatch mode, dynamo not disabled. Those fix every guard dynamo put on the graph except
the batch size's, which is unbacked and guards nothing. A graph that writes a batch tensor
is not learnt (dynamo guards their overlaps). Anything else goes through dynamo as before
(so an argument tensor that is neither long-lived nor marked unbacked sends every call
there).

The compiled function's contract, which dynamo does not need and this does: the globals it
reads never change, the long-lived tensors' sizes and strides never change in place, and
it has no Python side effects (dynamo replays those after its graph; a direct call does not).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from types import ModuleType
from typing import Any, cast

import torch
from torch import Tensor
from torch._C._dynamo.guards import GlobalStateGuard
from torch.utils._python_dispatch import _get_current_dispatch_mode

from hybridkv.ops.tensor_memo import TensorMemo, missing

# where an input of the graph comes from: ("arg", i) / ("field", i, j) a tensor argument
# or a tensor field of a tuple argument, ("const", value) a fixed tensor or size,
# ("batch",) the batch size
Source = tuple[Any, ...]


@dataclass(frozen=True)
class DirectCall:
    """A graph and how one set of arguments feeds it; called like the compiled function."""

    graph: Callable[..., Any]
    inputs: tuple[Source, ...]
    result: tuple[int, ...] | int  # the output index of each tuple element, or of a tensor
    state: GlobalStateGuard
    held: tuple[tuple[torch.dtype, int], ...]  # each long-lived tensor's dtype and address

    def __call__(self, args: Sequence[Any], batch: int) -> Any:
        flat = [_take(source, args, batch) for source in self.inputs]
        outputs = self.graph(*flat)
        if isinstance(self.result, int):
            return outputs[self.result]
        return tuple(outputs[i] for i in self.result)


def _take(source: Source, args: Sequence[Any], batch: int) -> Any:
    kind = source[0]
    if kind == "arg":
        return args[source[1]]
    if kind == "field":
        return args[source[1]][source[2]]
    if kind == "const":
        return source[1]
    return batch


@dataclass
class _Run:
    """What one run of a graph saw (the graph's runner fills it during a recorded call)."""

    graph: Callable[..., Any]
    size_kinds: tuple[str | None, ...]  # per input: None (tensor), "unbacked" or "backed"
    written: frozenset[int]  # the inputs the graph may write (over-approximated)
    inputs: tuple[Any, ...]
    outputs: Sequence[Any]


@dataclass
class _Recording:
    owner: DirectCalls
    run: _Run | None = None


_recording: ContextVar[_Recording | None] = ContextVar("hybridkv_direct_recording", default=None)


class DirectCalls:
    """The direct calls of one compiled function, per set of long-lived arguments."""

    def __init__(self) -> None:
        self._calls: TensorMemo[DirectCall] = TensorMemo()
        self.num_direct_calls = 0  # calls that skipped dynamo (tests read it)

    def clear(self) -> None:
        self._calls = TensorMemo()
        self.num_direct_calls = 0

    def backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
        """Inductor (``options`` as its config patches), with a runner that shows a recorded
        call the graph's inputs and outputs."""
        from torch._inductor.compile_fx import compile_fx

        graph = cast(
            Callable[..., Any],
            compile_fx(gm, example_inputs, config_patches=kwargs.get("options")),
        )
        kinds = tuple(_size_kind(node) for node in gm.graph.find_nodes(op="placeholder"))
        written = _written_inputs(gm)

        def run(*inputs: Any) -> Any:
            outputs = graph(*inputs)
            recording = _recording.get()
            if recording is not None and recording.owner is self and recording.run is None:
                recording.run = _Run(graph, kinds, written, inputs, outputs)
            return outputs

        return run

    def find(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[DirectCall, int] | None:
        """The direct call for these arguments and their batch size, if one was learnt."""
        if not self._calls or kwargs or not _plain_modes():
            return None
        layout = _layout(args)
        if layout is None:
            return None
        held, key, batch = layout
        call = self._calls.lookup(held, key)
        if missing(call):
            return None
        assert isinstance(call, DirectCall)
        if call.held != _held_layout(held) or not call.state.check():
            return None
        return call, batch

    def call(self, found: tuple[DirectCall, int], args: tuple[Any, ...]) -> Any:
        call, batch = found
        self.num_direct_calls += 1
        return call(args, batch)

    @contextmanager
    def recording(self) -> Iterator[_Recording]:
        """Around a call through dynamo: what its graph saw, for :meth:`learn` after it."""
        recording = _Recording(self)
        token = _recording.set(recording)
        try:
            yield recording
        finally:
            _recording.reset(token)

    def learn(
        self, recording: _Recording, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any
    ) -> None:
        """Remember the direct call of a recorded call, when everything maps (module doc)."""
        run, recording.run = recording.run, None
        if run is None or kwargs or not _plain_modes():
            return
        layout = _layout(args)
        if layout is None:
            return
        held, key, batch = layout
        state = GlobalStateGuard()
        inputs = _input_sources(run, args, batch)
        output_map = _result_map(result, run.outputs)
        if inputs is None or output_map is None:
            return
        call = DirectCall(run.graph, inputs, output_map, state, _held_layout(held))
        self._calls.remember(held, call, key)


@functools.cache
def _dynamo_frames() -> ModuleType:
    """``torch._dynamo.eval_frame``, imported on first use: by then a call was learnt or one
    is being compiled, so dynamo is loaded anyway; at this module's import it would cost
    seconds (hybridkv.ops.compiled). Cached: an import statement per call costs ~0.3 us."""
    import torch._dynamo.eval_frame as dynamo_frames

    return dynamo_frames


def _plain_modes() -> bool:
    """No torch-function or dispatch mode active and dynamo on as by default: what dynamo
    checks besides the global state guard (a mode sees no op of a direct call)."""
    return (
        torch._C._len_torch_function_stack() == 0
        and _get_current_dispatch_mode() is None
        and _dynamo_frames()._stance.stance == "default"
        and not torch._dynamo.config.disable
    )


def _size_kind(node: torch.fx.Node) -> str | None:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    value = node.meta.get("example_value")
    if not isinstance(value, torch.SymInt):
        return None
    return "unbacked" if free_unbacked_symbols(value) else "backed"


def _is_batch_tensor(t: Tensor) -> bool:
    return 0 in getattr(t, "_dynamo_unbacked_indices", ())


def _held_layout(held: tuple[Tensor, ...]) -> tuple[tuple[torch.dtype, int], ...]:
    """What an in-place change of a long-lived tensor (``param.data = ...``, a cast) would
    change: its dtype and address."""
    return tuple((t.dtype, t.data_ptr()) for t in held)


def _written_inputs(gm: torch.fx.GraphModule) -> frozenset[int]:
    """The placeholders an in-place op of the graph may write: the first argument (or an
    ``out=``) of a method or function named like an in-place op or ``setitem``, followed
    back through first arguments to a placeholder. Over-approximated (any op on the way
    counts as a view), which only costs a direct call."""
    placeholders = {node: i for i, node in enumerate(gm.graph.find_nodes(op="placeholder"))}
    written: set[int] = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
        targets = [node.kwargs["out"]] if "out" in node.kwargs else []
        if name in ("setitem", "__setitem__") or (name.endswith("_") and not name.endswith("__")):
            targets.append(node.args[0] if node.args else None)
        for base in targets:
            while isinstance(base, torch.fx.Node) and base not in placeholders and base.args:
                base = base.args[0]
            if base in placeholders:
                written.add(placeholders[base])
    return frozenset(written)


_PLAIN_VALUES = (type(None), bool, int, float, str)


def _layout(args: tuple[Any, ...]) -> tuple[tuple[Tensor, ...], Hashable, int] | None:
    """(the long-lived tensors, a key of everything else, the batch size), or None where
    the arguments cannot be told apart this way: nested containers, objects other than
    tensors, tuples of them and plain values, no batch tensor, batch tensors of unequal
    first sizes. The key tags every entry, keeps each value's type (2 is not 2.0, -0.0 is
    not 0.0) and where a batch tensor repeats an earlier one (dynamo gives the graph one
    input for both)."""
    held: list[Tensor] = []
    parts: list[Hashable] = [torch.is_inference_mode_enabled()]  # (global state: the guard)
    batch: int | None = None
    seen: dict[int, int] = {}  # batch tensor id -> its first position
    for arg in args:
        items = arg if isinstance(arg, tuple) else (arg,)
        parts.append(("tuple", type(arg), len(arg)) if isinstance(arg, tuple) else "arg")
        for item in items:
            if isinstance(item, Tensor):
                marks = getattr(item, "_dynamo_unbacked_indices", None)
                if marks:
                    if marks != {0}:  # an unbacked size that is not the batch's
                        return None
                    size = int(item.shape[0])
                    if batch is None:
                        batch = size
                    elif size != batch:
                        return None
                    first = seen.setdefault(id(item), len(parts))
                    parts.append(("batch", first, _batch_layout(item)))
                else:
                    held.append(item)
                    parts.append(("held", item.requires_grad))
            elif type(item) in _PLAIN_VALUES:
                value = item.hex() if type(item) is float else item
                parts.append(("value", type(item), value))
            else:
                return None
    if batch is None:
        return None
    return tuple(held), tuple(parts), batch


def _batch_layout(t: Tensor) -> Hashable:
    return (t.dtype, t.device, t.requires_grad, t.is_inference(), tuple(t.shape[1:]), t.stride())


def _input_sources(run: _Run, args: tuple[Any, ...], batch: int) -> tuple[Source, ...] | None:
    """Where each graph input of ``run`` comes from, or None if one cannot be placed."""
    places: dict[int, Source] = {}
    for i, arg in enumerate(args):
        if isinstance(arg, Tensor):
            places.setdefault(id(arg), ("arg", i))
        elif isinstance(arg, tuple):
            for j, item in enumerate(arg):
                if isinstance(item, Tensor):
                    places.setdefault(id(item), ("field", i, j))
    sources: list[Source] = []
    for i, (value, kind) in enumerate(zip(run.inputs, run.size_kinds, strict=True)):
        if isinstance(value, Tensor):
            if kind is not None or (i in run.written and _is_batch_tensor(value)):
                return None  # (a written batch tensor: dynamo guards their overlaps)
            place = places.get(id(value))
            if place is None and _is_batch_tensor(value):
                return None  # a batch tensor must come from the arguments
            sources.append(place if place is not None else ("const", value))
        elif kind == "unbacked":
            if value != batch:
                return None
            sources.append(("batch",))
        elif kind == "backed" and isinstance(value, int):
            sources.append(("const", value))
        else:
            return None
    resolved = [_take(s, args, batch) for s in sources]
    same = all(
        a is b if isinstance(a, Tensor) else a == b
        for a, b in zip(resolved, run.inputs, strict=True)
    )
    return tuple(sources) if same else None


def _result_map(result: Any, outputs: Sequence[Any]) -> tuple[int, ...] | int | None:
    """The output index of the result (or of each element of a tuple result) by identity,
    or None where the result is not made of the graph's outputs."""
    index = {id(o): i for i, o in enumerate(outputs) if isinstance(o, Tensor)}
    if isinstance(result, Tensor):
        return index.get(id(result))
    if type(result) is not tuple:  # (a named tuple: a direct call would return a plain one)
        return None
    found = tuple(index.get(id(r), -1) if isinstance(r, Tensor) else -1 for r in result)
    return None if -1 in found else found

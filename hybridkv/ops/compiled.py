"""torch.compile for the few ops where fusing passes over memory pays, eager otherwise.

Most of a step's ops are matmuls, which compiling does not speed up, or small ops whose
cost is dispatch. A few are long chains of elementwise passes over megabytes of state that
eager torch cannot fuse: the one-token recurrence of the gated delta rule reads a batch's
states from their pages, converts them to fp32, decays, updates and reads them, converts
back and writes them, eight passes over ~8 MB per layer at 64 requests. Compiled, the
chain is one loop that reads and writes each state once (measurements in the commit that
added this module and in docs/architecture.md); the GDN mixer's decode step
(:mod:`hybridkv.ops.gated_delta_rule.mixer_decode`) compiles it with the rest of a
decode's mixer, some sixty small ops eagerly.

A compiled op traces on its first call and compiles C++ (CPU) for it, once per process
for each dtype and layout; shapes are dynamic, so a new batch size or model of the same
layout compiles nothing, except that dynamo specialises a size of one and None arguments
(the GDN mixer's decode step avoids both: its batch size is unbacked and it always passes
its mask). An op that knows its layouts ahead compiles them when the engine starts
(``warm_up`` functions beside the op, called by the layers' ``warm_up_compiled`` from the
model runner), so serving never waits for a compile. Inductor keeps compiled code in its
on-disk cache, so a later process on the same machine skips the C++ compile: ~1.6 s for
the first graph then (most of it inductor's own start; later graphs ~0.1 s), ~8 s on a
machine whose cache is empty. Even warm, the imports of dynamo and inductor and the trace
cost seconds of every start-up, so the warm-up of the GDN decode step first loads a package
compiled ahead of time (:mod:`hybridkv.ops.ahead_of_time`), and this op compiles just in
time only where there is none. Where compiling cannot work (no C++
compiler, an unsupported platform) the op warns once and runs its eager form from then on;
the two forms agree up to rounding (sums in another order).

``HYBRIDKV_ENFORCE_EAGER=1`` runs every op eagerly in the process; :func:`running_eagerly`
in a block of code (the engine's ``enforce_eager``, vLLM's flag, wraps its steps in it).
Dynamo compiles a function again for each new combination of dtypes and layouts, up to its
recompile limit (8 per function); a call past it runs the eager form (one log line), so a
process that serves many models loses speed, never correctness.

Once dynamo has run a graph for some arguments, later calls with the same long-lived
tensors and batch tensors of the same layout call the graph directly, skipping dynamo's
per-call dispatch, which in a serving step costs more than many a graph
(:mod:`hybridkv.ops.direct_calls`).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Generic, ParamSpec, TypeVar

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from hybridkv.ops.direct_calls import DirectCalls

P = ParamSpec("P")
R = TypeVar("R")

logger = logging.getLogger(__name__)

_ENFORCE_EAGER = os.environ.get("HYBRIDKV_ENFORCE_EAGER", "").lower() in ("1", "true", "yes")
_eager_here: ContextVar[bool] = ContextVar("hybridkv_eager_ops", default=False)


@contextmanager
def running_eagerly() -> Iterator[None]:
    """Every op of this module runs eagerly inside the block (this thread or task only)."""
    token = _eager_here.set(True)
    try:
        yield
    finally:
        _eager_here.reset(token)


def compile_enabled() -> bool:
    """Whether the ops of this module compile here and now."""
    return not (_ENFORCE_EAGER or _eager_here.get())


@functools.cache
def _failures() -> tuple[tuple[type[Exception], ...], tuple[type[Exception], ...]]:
    """(raised while compiling, raised for one call): the second for a combination of inputs
    past the recompile limit (or a graph break, which would be a bug in a fused form), other
    combinations staying compiled.

    Imported here, on the first compile, not with this module: dynamo and inductor take
    ~1.6-3 s to import on a slow machine (measured on a 2-core AVX2 EPYC: ``import
    torch._dynamo`` 1.7 s, inductor's compiler 1.35 s more), which a model without compiled
    ops (every family but the Gated DeltaNet ones) or an ``enforce_eager`` engine would pay
    at start-up for nothing."""
    from torch._dynamo.exc import BackendCompilerFailed, FailOnRecompileLimitHit, Unsupported
    from torch._inductor.exc import InductorError

    return (BackendCompilerFailed, InductorError), (FailOnRecompileLimitHit, Unsupported)


def _tracks_grad(args: tuple[object, ...]) -> bool:
    """Autograd records this call. The eager forms update state in place in workspace
    buffers, which cannot be differentiated; their callers take a differentiable path then
    (:func:`hybridkv.ops.paged_state.scan_each_request`) and never get here, but a compiled
    graph must not be traced for autograd either."""
    return torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args)


def _variant(args: tuple[object, ...]) -> tuple[object, ...]:
    """What dynamo compiles a new graph for, roughly: dtypes, ranks, a size-one first dim,
    None arguments and the autograd mode."""
    parts: list[object] = [torch.is_inference_mode_enabled(), torch.is_grad_enabled()]
    for a in args:
        if isinstance(a, Tensor):
            parts.append((a.dtype, a.dim(), a.dim() > 0 and a.shape[0] == 1))
        else:
            parts.append(a is None)
    return tuple(parts)


class CompiledOp(Generic[P, R]):
    """``fused`` compiled on first use (dynamic shapes), or ``eager`` where it does not compile.

    Two functions of one signature and one result (up to rounding): ``fused`` is written
    for the compiler (one expression per pass, which inductor fuses, but slow run
    eagerly); ``eager`` is the fastest form for eager torch (in-place updates, bmm,
    workspace buffers). Default ``eager``: ``fused`` itself.
    """

    def __init__(self, fused: Callable[P, R], eager: Callable[P, R] | None = None) -> None:
        self.fused = fused
        self.eager = eager or fused
        self._compiled: Callable[P, R] | None = None
        self._failed = False
        self._eager_variants: set[tuple[object, ...]] = set()
        self.direct = DirectCalls()  # the graph called without dynamo's dispatch
        self.num_compiled_calls = 0  # calls that ran the compiled graph (tests read it)

    def reset(self) -> None:
        """Forget the compiled function, failures and counts (what torch._dynamo.reset()
        drops on dynamo's side; tests use the two together)."""
        self._compiled = None
        self._failed = False
        self._eager_variants.clear()
        self.direct.clear()
        self.num_compiled_calls = 0

    def will_compile(self) -> bool:
        """Whether a call here and now would run (or compile) the fused form."""
        return not self._failed and compile_enabled()

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if not self.will_compile() or _tracks_grad(args) or _get_current_dispatch_mode():
            return self.eager(*args, **kwargs)  # (dynamo refuses to run under a user's mode)
        if self._eager_variants and _variant(args) in self._eager_variants:
            return self.eager(*args, **kwargs)
        direct = self.direct.find(args, kwargs)
        if direct is not None:  # a graph dynamo ran for these arguments before
            self.num_compiled_calls += 1
            return self.direct.call(direct, args)  # type: ignore[no-any-return]
        try:
            compile_failures, call_failures = _failures()
        except ImportError as exc:  # a broken dynamo or inductor install
            self._fail(exc)
            return self.eager(*args, **kwargs)
        if self._compiled is None:
            try:
                self._compiled = torch.compile(
                    self.fused,
                    backend=self.direct.backend,
                    dynamic=True,
                    fullgraph=True,
                    options=_compile_options(),
                )
            except RuntimeError as exc:  # torch.compile refuses this Python or platform
                self._fail(exc)
                return self.eager(*args, **kwargs)
        try:
            with self.direct.recording() as recording:
                out = self._compiled(*args, **kwargs)
        except compile_failures as exc:  # raised while compiling, before anything ran
            self._fail(exc)
            return self.eager(*args, **kwargs)
        except call_failures as exc:  # this combination of inputs only (nothing ran)
            variant = _variant(args)
            self._eager_variants.add(variant)
            logger.warning(
                "%s runs eagerly for inputs %s: %s",
                self.fused.__qualname__,
                variant,
                _first_line(exc),
            )
            return self.eager(*args, **kwargs)
        self.direct.learn(recording, args, kwargs, out)
        self.num_compiled_calls += 1
        return out

    def _fail(self, exc: Exception) -> None:
        self._failed = True
        logger.warning(
            "torch.compile of %s failed, running it eagerly: %s",
            self.fused.__qualname__,
            _first_line(exc),
        )


def _compile_options() -> dict[str, str | int | bool | Callable[..., Any]]:
    """Inductor options of every compiled op: trust the CPU's vector flags instead of
    probing them (unless ``TORCHINDUCTOR_VEC_ISA_OK`` says otherwise). Before its first
    compile in a process, inductor dry-compiles a C++ file for each ISA the CPU reports and
    loads it in a child Python: the small Qwen3-Next's warm-up (compile cache warm) took
    2.34-2.38 s with the probe and 1.56-1.65 s without (3 interleaved pairs). A compiler
    that then cannot build for the ISA fails the compile, and the op runs eagerly (as on
    any compile error)."""
    from torch._inductor import config as inductor_config

    if inductor_config.cpp.vec_isa_ok is not None:  # the user chose
        return {}
    return {"cpp.vec_isa_ok": True}


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__

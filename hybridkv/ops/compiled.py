"""torch.compile for the few ops where fusing passes over memory pays, eager otherwise.

Most of a step's ops are matmuls, which compiling does not speed up, or small ops whose
cost is dispatch. A few are long chains of elementwise passes over megabytes of state that
eager torch cannot fuse: the one-token recurrence of the gated delta rule reads a batch's
states from their pages, converts them to fp32, decays, updates and reads them, converts
back and writes them, eight passes over ~8 MB per layer at 64 requests. Compiled, the
chain is one loop that reads and writes each state once (measurements in the commit that
added this module and in docs/architecture.md).

A compiled op traces on its first call and compiles C++ (CPU) for it, once per process
for each set of dtypes and devices; shapes are dynamic, so a new batch size or model
compiles nothing. Inductor keeps compiled code in its on-disk cache, so later processes
on the same machine skip the C++ compile. Where compiling cannot work (no C++ compiler,
an unsupported platform) the op warns once and runs eagerly from then on; the results
differ from the eager ones only in rounding (the sums run in another order).

``HYBRIDKV_ENFORCE_EAGER=1`` runs every op eagerly in the process; :func:`running_eagerly`
in a block of code (the engine's ``enforce_eager``, vLLM's flag, wraps its steps in it).
Dynamo compiles a function again for new dtypes or layouts, up to its recompile limit (8);
past it, dynamo runs the function eagerly (a warning in its log), so a process that serves
many models loses speed, never correctness.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Generic, ParamSpec, TypeVar

import torch
from torch._dynamo.exc import BackendCompilerFailed
from torch._inductor.exc import InductorError

P = ParamSpec("P")
R = TypeVar("R")

logger = logging.getLogger(__name__)

_COMPILE_FAILURES = (BackendCompilerFailed, InductorError)
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


def _tracks_grad(args: tuple[object, ...]) -> bool:
    """Autograd records this call: the ops here update state in place, which only the
    eager path's callers handle (they take another path under autograd anyway)."""
    return torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args
    )


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

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if self._failed or not compile_enabled() or _tracks_grad(args):
            return self.eager(*args, **kwargs)
        if self._compiled is None:
            self._compiled = torch.compile(self.fused, dynamic=True)
        try:
            return self._compiled(*args, **kwargs)
        except _COMPILE_FAILURES as exc:  # raised while compiling, before anything ran
            self._failed = True
            logger.warning(
                "torch.compile of %s failed, running it eagerly: %s",
                self.fused.__qualname__,
                str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
            )
            return self.eager(*args, **kwargs)

"""Compiled steps kept on disk as shared libraries and loaded without the compiler.

A compiled op (:mod:`hybridkv.ops.compiled`) costs every start-up the import of dynamo and
inductor and a trace of its function: on a slow 2-core machine ~1.6 s, ~1.35 s and ~2.2 s,
most of a 9 s start-up that runs in under 3 s without them. AOTInductor compiles an
exported function once into a package (a ``.pt2`` archive holding a shared library) that
torch's C++ loader opens in milliseconds, with neither dynamo nor inductor imported. So a
step that must be compiled is exported and compiled ahead of time the first time a
machine meets its layout, the package stored under a key of everything its code depends
on, and every later process loads it.

The key covers: this format's version, torch's version, the CPU's vector ISA and the
machine, the number of torch threads (inductor writes it into the code), the sources of
the modules the step is made of, and each input's dtype, device, static sizes and strides.
A package is written to a temporary name and renamed, so two processes building the same
one never see half of it. The directory is ``$HYBRIDKV_AOT_CACHE`` or
``~/.cache/hybridkv/aot`` (``$XDG_CACHE_HOME`` respected); ``HYBRIDKV_AOT_CACHE=off``
turns the mechanism off, and the op's caller compiles just in time instead.

Building costs more than a just-in-time compile (~20-35 s on that machine against ~8-15
s), once per machine and layout. Where exporting, compiling or loading fails, the caller
gets None, with one warning, and keeps its just-in-time form.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from torch.export import ExportedProgram

logger = logging.getLogger(__name__)

CACHE_ENV = "HYBRIDKV_AOT_CACHE"
_OFF = ("off", "0", "false", "no", "")
FORMAT_VERSION = 1  # bump when what a package holds or how it is called changes


def cache_dir() -> Path | None:
    """Where packages live, or None when ahead-of-time compiling is off."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen is not None:
        return None if chosen.strip().lower() in _OFF else Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hybridkv" / "aot"


def available() -> bool:
    """Whether this torch can load packages (its C++ loader built in) and the cache is on."""
    return cache_dir() is not None and hasattr(torch._C, "_aoti")


@functools.cache
def _source_digest(modules: tuple[ModuleType, ...]) -> str:
    """sha256 of the modules' source files, read once per process."""
    digest = hashlib.sha256()
    for module in modules:
        path = getattr(module, "__file__", None)
        digest.update(module.__name__.encode())
        digest.update(Path(path).read_bytes() if path else b"")
    return digest.hexdigest()


def _describe(t: Tensor, dynamic_first_dim: bool) -> str:
    """dtype, device, sizes (a dynamic first one as ``*``) and strides: a page view's first
    stride is fixed by the arena's layout, a contiguous batch's by the sizes after it."""
    sizes = [str(s) for s in t.shape]
    if dynamic_first_dim:
        sizes[0] = "*"
    return f"{t.dtype}/{t.device.type}/{','.join(sizes)}/{','.join(map(str, t.stride()))}"


def package_key(
    name: str,
    modules: Sequence[ModuleType],
    inputs: Sequence[Tensor],
    dynamic_first_dim: Sequence[bool],
) -> str:
    """A file name for the package of step ``name`` over ``inputs`` (the module doc says
    what it covers)."""
    parts = [
        f"format {FORMAT_VERSION}",
        f"torch {torch.__version__}",
        f"isa {torch.backends.cpu.get_cpu_capability()}",
        f"machine {platform.machine()} {platform.system()}",
        f"threads {torch.get_num_threads()}",
        f"sources {_source_digest(tuple(modules))}",
    ]
    parts += [_describe(t, d) for t, d in zip(inputs, dynamic_first_dim, strict=True)]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()
    return f"{name}-{digest[:24]}"


class AheadOfTimeStep:
    """A loaded package: called with the exported function's tensors, flat and in order,
    returns its outputs as a list."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # (package, model name, run single-threaded, runners, device index): one runner,
        # run on the calling thread; the engine calls a step from one thread at a time
        self._loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", True, 1, -1)
        self.num_calls = 0

    def __call__(self, *tensors: Tensor) -> list[Tensor]:
        self.num_calls += 1
        return self._loader.boxed_run(list(tensors))


# packages loaded in this process, by path: layers of one layout share one
_LOADED: dict[Path, AheadOfTimeStep] = {}


def loaded_steps() -> list[AheadOfTimeStep]:
    """Every package loaded in this process (tests count their calls)."""
    return list(_LOADED.values())


def load_or_build(key: str, export: Callable[[], ExportedProgram]) -> AheadOfTimeStep | None:
    """The package ``key`` loaded, built first (``export()`` then AOTInductor) when the
    cache lacks it; None, with a warning, where any of it fails or the cache is off. A
    package is loaded once per process."""
    directory = cache_dir()
    if directory is None or not hasattr(torch._C, "_aoti"):
        return None
    path = directory / f"{key}.pt2"
    if path in _LOADED:
        return _LOADED[path]
    try:
        if not path.exists():
            _build(path, export)
        step = _LOADED[path] = AheadOfTimeStep(path)
        return step
    except Exception as exc:  # any failure means the just-in-time form
        logger.warning(
            "ahead-of-time compile of %s failed, compiling it in process instead: %s",
            key,
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        )
        return None


def _build(path: Path, export: Callable[[], ExportedProgram]) -> None:
    """Export, compile and store one package (atomically: module doc)."""
    logger.info(
        "compiling %s ahead of time: once per machine and model layout (~20-40 s), "
        "loaded from %s by later processes",
        path.stem,
        path.parent,
    )
    start = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.stem}.{os.getpid()}.partial.pt2")
    try:
        with _progress(path.stem), warnings.catch_warnings():  # (torch's own deprecations)
            warnings.simplefilter("ignore", (DeprecationWarning, FutureWarning))
            program = export()
            from torch._inductor import aoti_compile_and_package

            aoti_compile_and_package(program, package_path=str(partial))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    logger.info("compiled %s in %.1f s", path.stem, time.perf_counter() - start)


@contextlib.contextmanager
def _progress(name: str) -> Iterator[None]:
    """A spinner with the time elapsed on a terminal's stderr while a package builds: half
    a minute of silence at start-up would look like a hang."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    columns = (
        SpinnerColumn(),
        TextColumn(f"compiling {name.rsplit('-', 1)[0]} (once per machine)"),
        TimeElapsedColumn(),
    )
    with Progress(
        *columns, console=console, transient=True, disable=not console.is_terminal
    ) as spinner:
        spinner.add_task(name, total=None)  # a row to draw
        yield

"""Compiled steps kept on disk as shared libraries and loaded without the compiler.

A compiled op (:mod:`hybridkv.ops.compiled`) costs every start-up the import of dynamo and
inductor and a trace of its function: on a slow 2-core machine ~1.6 s, ~1.35 s and ~2.2 s,
most of a 9 s start-up that runs in under 3 s without them. AOTInductor compiles an
exported function once into a package (a ``.pt2`` archive holding a shared library) that
torch's C++ loader opens in milliseconds, with neither dynamo nor inductor imported. So a
step that must be compiled is exported and compiled ahead of time the first time a
machine meets its layout, the package stored under a key of everything its code depends
on, and every later process loads it.

The key covers: this format's version, torch's version, the CPU's vector ISA, model and
feature flags (inductor builds for the building CPU), the machine, the environment that
changes what inductor builds, the number of torch threads (inductor writes it into the
code), the sources of the modules the step is made of, what else the step bakes in when
its caller describes it (a model's config constants), and each input's dtype, device,
static sizes and strides. A package is written to a temporary name and renamed, so two
processes building the same one never see half of it; a failure leaves a marker file.
The directory is ``$HYBRIDKV_AOT_CACHE`` or ``~/.cache/hybridkv/aot`` (``$XDG_CACHE_HOME``
respected); ``HYBRIDKV_AOT_CACHE=off`` turns the mechanism off, and the op's caller
compiles just in time instead.

Building costs more than a just-in-time compile (~25-35 s on that machine against ~8-15
s; a whole-model graph 40-95 s), once per machine and layout: the tiny demo model's five
packages took 199 s on a 2-core AVX2 machine, its later runs 4.7 s in all. Where
exporting, compiling or loading fails, the caller gets None, with one warning, and keeps
its just-in-time form.
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
    """Whether this torch can load packages (its C++ loader built in) and the cache is on.

    Off too under ``AOTI_RUNTIME_CHECK_INPUTS``, AOTInductor's debugging checks: a package
    declares its batch size >= 2 (torch specialises sizes of one), which those checks
    enforce, while its loops run a batch of one as any other (a lone row is the same bits
    as in a batch: tests/ops/test_ahead_of_time.py)."""
    return (
        cache_dir() is not None
        and hasattr(torch._C, "_aoti")
        and os.environ.get("AOTI_RUNTIME_CHECK_INPUTS", "0") in ("", "0")
    )


@functools.cache
def _source_digest(modules: tuple[ModuleType, ...]) -> str:
    """sha256 of the modules' source files, read once per process."""
    digest = hashlib.sha256()
    for module in modules:
        path = getattr(module, "__file__", None)
        digest.update(module.__name__.encode())
        digest.update(Path(path).read_bytes() if path else b"")
    return digest.hexdigest()


@functools.cache
def _cpu_digest() -> str:
    """sha256 of the CPU's model and feature flags: inductor compiles packages for the
    building CPU (``-march=native``), which another CPU of the same ISA level may lack
    (an illegal instruction is a crash, not an exception). From ``/proc/cpuinfo`` on
    Linux, else what ``platform`` knows."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    picked = sorted({line for line in lines if line.split(":", 1)[0].strip() in wanted})
    picked.append(platform.processor())
    return hashlib.sha256("\n".join(picked).encode()).hexdigest()[:16]


@functools.cache
def _build_environment() -> str:
    """The environment variables that change what inductor builds: its own options and the
    C++ compiler chosen; read once per process, before anything builds (importing
    inductor sets ``TORCHINDUCTOR_CACHE_DIR``, and a key must not change with it: the
    second layer of a model would build its package again), cache directories left out."""
    prefixes = ("TORCHINDUCTOR_", "AOT_INDUCTOR_", "TORCH_COMPILE_")
    chosen = sorted(
        f"{k}={v}"
        for k, v in os.environ.items()
        if (k.startswith(prefixes) or k in ("CXX", "CC")) and not k.endswith("CACHE_DIR")
    )
    return hashlib.sha256("\n".join(chosen).encode()).hexdigest()[:16]


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
    extra: str = "",
) -> str:
    """A file name for the package of step ``name`` over ``inputs`` (the module doc says
    what it covers); ``extra`` describes what else the step bakes in (a model's config
    constants)."""
    parts = [
        f"format {FORMAT_VERSION}",
        f"torch {torch.__version__}",
        f"isa {torch.backends.cpu.get_cpu_capability()}",
        f"machine {platform.machine()} {platform.system()}",
        f"cpu {_cpu_digest()}",
        f"build {_build_environment()}",
        f"threads {torch.get_num_threads()}",
        f"sources {_source_digest(tuple(modules))}",
    ]
    if extra:  # (absent from the other steps' keys, which it would have changed)
        parts.append(f"extra {extra}")
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


# per step name, the packages kept: those used in the last UNUSED_DAYS days, at most
# KEEP_PACKAGES of them (the most recently used). A count alone made the test suite,
# whose tiny models have more than eight layouts of the GDN decode step, delete and
# rebuild packages on every run (~20 s each)
KEEP_PACKAGES = 64
UNUSED_DAYS = 30


def load_or_build(
    key: str,
    export: Callable[[], ExportedProgram],
    inductor_options: dict[str, object] | None = None,
) -> AheadOfTimeStep | None:
    """The package ``key`` loaded, built first (``export()`` then AOTInductor with
    ``inductor_options``; the caller's key must cover them) when the cache lacks it;
    None, with a warning, where the cache is off or cannot be written, or any of it
    fails. A package is loaded once per process.

    A failure leaves a ``<key>.failed`` file holding the error, so later processes do not
    spend half a minute failing again (each warns; deleting the file retries).
    """
    directory = cache_dir()
    if directory is None or not available():
        return None
    path = directory / f"{key}.pt2"
    if path in _LOADED:
        return _LOADED[path]
    failed = path.with_suffix(".failed")
    if failed.exists():
        logger.warning(
            "the ahead-of-time compile of %s failed before (%s); compiling it in process "
            "instead (delete that file to try again)",
            key,
            failed,
        )
        return None
    try:
        if not path.exists():
            directory.mkdir(parents=True, exist_ok=True)
            if not os.access(directory, os.W_OK):
                raise PermissionError(f"{directory} is not writable")
            _build(path, export, inductor_options)
            _prune(directory, key.rsplit("-", 1)[0])
        step = _LOADED[path] = AheadOfTimeStep(path)
        os.utime(path)  # recently used: kept by _prune
        return step
    except Exception as exc:  # any failure means the just-in-time form
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        logger.warning(
            "ahead-of-time compile of %s failed, compiling it in process instead: %s",
            key,
            message,
        )
        if path.parent.is_dir() and os.access(path.parent, os.W_OK):
            failed.write_text(f"{type(exc).__name__}: {message}\n")
        return None


def _prune(directory: Path, name: str) -> None:
    """Delete the packages of step ``name`` (each source change or torch upgrade makes new
    ones) unused for :data:`UNUSED_DAYS` days or past the :data:`KEEP_PACKAGES` most
    recently used, and partial files of builds that died more than an hour ago."""
    now = time.time()
    packages = sorted(
        directory.glob(f"{name}-*.pt2"), key=lambda p: p.stat().st_mtime, reverse=True
    )
    unused = [p for p in packages if now - p.stat().st_mtime > UNUSED_DAYS * 86400]
    stale = [p for p in directory.glob(f".{name}-*.partial.pt2") if now - p.stat().st_mtime > 3600]
    for old in [*packages[KEEP_PACKAGES:], *unused, *stale]:
        old.unlink(missing_ok=True)
        old.with_suffix(".failed").unlink(missing_ok=True)


def _build(
    path: Path,
    export: Callable[[], ExportedProgram],
    inductor_options: dict[str, object] | None = None,
) -> None:
    """Export, compile and store one package (atomically: module doc)."""
    logger.info(
        "compiling %s ahead of time: once per machine and model layout (~15-100 s), "
        "loaded from %s by later processes",
        path.stem,
        path.parent,
    )
    start = time.perf_counter()
    partial = path.with_name(f".{path.stem}.{os.getpid()}.partial.pt2")
    try:
        with _progress(path.stem), warnings.catch_warnings():  # (torch's own deprecations)
            warnings.simplefilter("ignore", (DeprecationWarning, FutureWarning))
            program = export()
            from torch._inductor import aoti_compile_and_package

            aoti_compile_and_package(
                program, package_path=str(partial), inductor_configs=inductor_options
            )
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

"""The GDN decode step compiled ahead of time (hybridkv.ops.ahead_of_time): built once per
layout into a package that later warm-ups load, equal to the eager step up to rounding, a
row's result independent of what shares its step, and the just-in-time form wherever no
package can be built or loaded."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_gdn_mixer_decode import decode, group_pages, page_bytes, projections, weights
from torch import Tensor

from hybridkv.ops import ahead_of_time
from hybridkv.ops.compiled import running_eagerly
from hybridkv.ops.gated_delta_rule import mixer_decode as fused


@pytest.fixture
def ahead(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Path]]:
    """Packages on, in the engine's own cache (``$HYBRIDKV_AOT_CACHE`` or the default),
    so a layout is built (~20-40 s) on the first run of the suite on a machine and loaded
    by the later ones, as an engine's would be; yields the packages built meanwhile (the
    build itself is tested across processes in tests/engine/test_engine_startup.py)."""
    built: list[Path] = []
    build = ahead_of_time._build

    def counted(path: Path, export: Callable[[], Any], *options: Any) -> None:
        build(path, export, *options)
        built.append(path)

    monkeypatch.setattr(ahead_of_time, "_build", counted)
    if ahead_of_time.cache_dir() is None:  # the suite's caller turned them off
        pytest.skip(f"{ahead_of_time.CACHE_ENV} is off")
    yield built


def warmed(num_pages: int, dtype: torch.dtype, seed: int = 3) -> tuple[Tensor, Tensor, Tensor]:
    """group_pages whose views the step was warmed up on (their package loaded)."""
    arena, conv, ssm = group_pages(num_pages, dtype, seed)
    fused.warm_up_mixer_decode(conv, ssm, weights(dtype))
    assert fused.compiled_ahead_of_time(conv, ssm)
    return arena, conv, ssm


def package_calls() -> int:
    return sum(step.num_calls for step in ahead_of_time.loaded_steps())


def test_warm_up_loads_one_package_per_layout_and_puts_the_pages_back(
    ahead: list[Path],
) -> None:
    """Warm-ups of one layout (other arenas, page counts) share one package, built at most
    once, loaded from the cache; each puts its pages' bytes back (NaN poison included),
    and decodes over warmed views run the package, never the just-in-time graph."""
    dtype = torch.bfloat16
    jit_calls = fused._mixer_decode.num_compiled_calls
    for num_pages in (20, 33):
        arena, conv, ssm = group_pages(num_pages, dtype)
        arena.view(dtype).fill_(float("nan"))
        before = arena.clone()
        fused.warm_up_mixer_decode(conv, ssm, weights(dtype))
        assert torch.equal(arena, before)
        assert fused.compiled_ahead_of_time(conv, ssm)
    assert len(ahead) <= 1
    cache = ahead_of_time.cache_dir()
    assert (
        cache is not None
        and (cache / f"{key_of(conv, ssm, dtype, 'gdn-mixer-decode')}.pt2").exists()
    )
    _, conv, ssm = warmed(12, dtype)
    calls = package_calls()
    decode(projections(6, dtype), [0, 2, 5], [3, 1, 7], [False, True, False], conv, ssm,
           weights(dtype))  # fmt: skip
    assert package_calls() == calls + 1
    assert fused._mixer_decode.num_compiled_calls == jit_calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_packaged_step_equals_the_eager_one(ahead: list[Path], dtype: torch.dtype) -> None:
    """The package against the eager step, the decodes picked out of a step with other
    rows: outputs and written states equal up to rounding, the conv states exactly, no NaN
    from a fresh row's garbage, and not a byte changed outside the decodes' own states."""
    pages, fresh = [7, 2, 11, 0, 5, 9], [False, True, False, False, True, False]
    rows = [1, 2, 4, 5, 8, 9]  # of a 10-row step
    w, inputs = weights(dtype), projections(10, dtype)
    arena, conv, ssm = warmed(12, dtype)
    calls = package_calls()
    out = decode(inputs, rows, pages, fresh, conv, ssm, w)
    assert package_calls() == calls + 1
    _, want_conv, want_ssm = group_pages(12, dtype)
    with running_eagerly():
        want = decode(inputs, rows, pages, fresh, want_conv, want_ssm, w)
    assert not out.isnan().any() and not ssm[pages].isnan().any()
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 5e-2, "atol": 5e-2}
    torch.testing.assert_close(out.float(), want.float(), **tol)
    torch.testing.assert_close(ssm[pages].float(), want_ssm[pages].float(), **tol)
    assert torch.equal(conv[pages], want_conv[pages])
    before, conv_view, ssm_view = group_pages(12, dtype)
    touched = page_bytes(before, conv_view, pages) | page_bytes(before, ssm_view, pages)
    assert torch.equal(arena[~touched], before[~touched])


def test_a_packaged_decode_does_not_depend_on_what_shares_its_step(ahead: list[Path]) -> None:
    """Caching on and off put a request's decodes in different steps: each decode's output
    and states are the same bits alone, in a decode-only step and among a mixed step's
    rows; alone it writes not a byte of the arena but its own states."""
    dtype = torch.bfloat16
    pages, rows = [3, 8, 1, 6], [0, 3, 4, 7]  # the decodes' rows in a 9-row mixed step
    w, step = weights(dtype), projections(9, dtype)
    mixed_arena, conv, ssm = warmed(10, dtype)
    mixed = decode(step, rows, pages, None, conv, ssm, w)
    only_arena, conv, ssm = warmed(10, dtype)
    only = decode(tuple(t[rows] for t in step), [0, 1, 2, 3], pages, None, conv, ssm, w)
    assert torch.equal(mixed, only) and torch.equal(mixed_arena, only_arena)
    for i, (row, page) in enumerate(zip(rows, pages, strict=True)):
        alone_arena, conv, ssm = warmed(10, dtype)
        alone = decode(tuple(t[row : row + 1] for t in step), [0], [page], None, conv, ssm, w)
        assert torch.equal(alone[0], mixed[i])
        mine = page_bytes(alone_arena, conv, [page]) | page_bytes(alone_arena, ssm, [page])
        assert torch.equal(alone_arena[mine], mixed_arena[mine])
        untouched = group_pages(10, dtype)[0]
        assert torch.equal(alone_arena[~mine], untouched[~mine])


def key_of(
    conv: Tensor, ssm: Tensor, dtype: torch.dtype, name: str = "step", batch: int = 5
) -> str:
    """The package key of the step over these views for ``batch`` decodes."""
    inputs = [t[:batch].contiguous() for t in projections(batch, dtype)]
    pages, fresh = torch.arange(batch), torch.zeros(batch, dtype=torch.bool)
    views = fused.StepViews(conv, ssm, ssm)
    flat = fused._flat_inputs(inputs, pages, fresh, views, fused._step_params(weights(dtype)))
    return ahead_of_time.package_key(name, fused._SOURCES, flat, fused._DYNAMIC_FIRST)


def test_the_key_names_the_layout_not_the_arena() -> None:
    """One package per layout: arenas of other page counts and batches of other sizes share
    a key; another dtype, another thread count or another state size does not."""
    dtype = torch.bfloat16
    _, conv, ssm = group_pages(10, dtype)
    _, big_conv, big_ssm = group_pages(40, dtype)
    key = key_of(conv, ssm, dtype)
    assert key_of(big_conv, big_ssm, dtype, batch=17) == key
    _, conv32, ssm32 = group_pages(10, torch.float32)
    assert key_of(conv32, ssm32, torch.float32) != key
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert key_of(conv, ssm, dtype) != key
    finally:
        torch.set_num_threads(threads)
    narrower = torch.as_strided(ssm, (10, 4, 16, 11), ssm.stride(), ssm.storage_offset())
    assert key_of(conv, narrower, dtype) != key
    # the same sizes in pages of another stride (another arena layout): another package
    wider = (ssm.stride()[0] + 64, *ssm.stride()[1:])
    assert key_of(conv, torch.as_strided(ssm, (5, *ssm.shape[1:]), wider, 0), dtype) != key
    inputs = [t[:5].contiguous() for t in projections(5, dtype)]
    views = fused.StepViews(conv, ssm, ssm)
    params = fused._step_params(weights(dtype))
    fresh = torch.zeros(5, dtype=torch.bool)
    int64, int32 = (
        ahead_of_time.package_key(
            "step",
            fused._SOURCES,
            fused._flat_inputs(inputs, torch.arange(5, dtype=index), fresh, views, params),
            fused._DYNAMIC_FIRST,
        )
        for index in (torch.int64, torch.int32)
    )
    assert int64 == key and int32 != key


def test_a_package_that_cannot_be_loaded_leaves_the_just_in_time_form(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A package file that is not one (a disk full, a foreign file): one warning, the views
    decode through the just-in-time form, and equal the eager step."""
    monkeypatch.setenv(ahead_of_time.CACHE_ENV, str(tmp_path))

    def broken_build(path: Path, export: Callable[[], object]) -> None:
        path.write_bytes(b"not a package")

    monkeypatch.setattr(ahead_of_time, "_build", broken_build)
    dtype = torch.float32
    w = weights(dtype)
    _, conv, ssm = group_pages(12, dtype, seed=5)
    with caplog.at_level(logging.WARNING, logger=ahead_of_time.__name__):
        fused.warm_up_mixer_decode(conv, ssm, w)
    assert not fused.compiled_ahead_of_time(conv, ssm)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "compiling it in process instead" in caplog.records[0].getMessage()
    [marker] = tmp_path.glob("*.failed")  # later processes do not fail again at length
    caplog.clear()

    def no_build(path: Path, export: Callable[[], object]) -> None:
        raise AssertionError("built again after a failure")

    monkeypatch.setattr(ahead_of_time, "_build", no_build)
    monkeypatch.setattr(ahead_of_time, "_LOADED", {})
    _, other_conv, other_ssm = group_pages(12, dtype, seed=7)
    with caplog.at_level(logging.WARNING, logger=ahead_of_time.__name__):
        fused.warm_up_mixer_decode(other_conv, other_ssm, w)
    assert not fused.compiled_ahead_of_time(other_conv, other_ssm)
    assert "failed before" in caplog.records[0].getMessage() and str(marker) in caplog.text
    inputs, pages = projections(4, dtype), [3, 1, 7, 2]
    out = decode(inputs, [0, 1, 2, 3], pages, None, conv, ssm, w)
    _, want_conv, want_ssm = group_pages(12, dtype, seed=5)
    with running_eagerly():
        want = decode(inputs, [0, 1, 2, 3], pages, None, want_conv, want_ssm, w)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_off_builds_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``HYBRIDKV_AOT_CACHE=off``: no package is built or looked for."""
    monkeypatch.setenv(ahead_of_time.CACHE_ENV, "off")
    assert ahead_of_time.cache_dir() is None and not ahead_of_time.available()

    def no_build(path: Path, export: Callable[[], object]) -> None:
        raise AssertionError("built with the cache off")

    monkeypatch.setattr(ahead_of_time, "_build", no_build)
    _, conv, ssm = group_pages(12, torch.float32, seed=6)
    fused.warm_up_mixer_decode(conv, ssm, weights(torch.float32))
    assert not fused.compiled_ahead_of_time(conv, ssm)
    monkeypatch.setenv(ahead_of_time.CACHE_ENV, str(tmp_path / "c"))
    assert ahead_of_time.cache_dir() == tmp_path / "c"


def test_a_cache_that_cannot_be_written_builds_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A cache directory that cannot be created or written: one warning at once, not half
    a minute of building first; the views decode just in time."""
    monkeypatch.setenv(ahead_of_time.CACHE_ENV, "/proc/hybridkv-aot")

    def no_build(path: Path, export: Callable[[], object]) -> None:
        raise AssertionError("built into an unwritable cache")

    monkeypatch.setattr(ahead_of_time, "_build", no_build)
    _, conv, ssm = group_pages(12, torch.float32, seed=8)
    with caplog.at_level(logging.WARNING, logger=ahead_of_time.__name__):
        fused.warm_up_mixer_decode(conv, ssm, weights(torch.float32))
    assert not fused.compiled_ahead_of_time(conv, ssm)
    assert len(caplog.records) == 1 and "/proc/hybridkv-aot" in caplog.text


def test_strided_indices_take_the_just_in_time_form(ahead: list[Path]) -> None:
    """A package reads its inputs as laid out when it was built: strided pages (every
    other element of a tensor) would update other requests' states. Such a call takes the
    just-in-time form and equals the eager step; the engine's own indices are contiguous."""
    dtype = torch.float32
    w = weights(dtype)
    _, conv, ssm = warmed(12, dtype)
    inputs = projections(3, dtype)
    every_other = torch.tensor([3, 0, 5, 0, 1, 0])[::2]
    calls = package_calls()
    with torch.inference_mode():
        rows = fused.DecodeRows(rows=torch.arange(3), pages=every_other, fresh=None)
        out = fused.gated_deltanet_decode(*(t.clone() for t in inputs), rows, conv, ssm, w)
    assert package_calls() == calls
    _, want_conv, want_ssm = group_pages(12, dtype)
    with running_eagerly():
        want = decode(inputs, [0, 1, 2], [3, 5, 1], None, want_conv, want_ssm, w)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(conv, want_conv)


def test_pruning_keeps_recent_packages_and_deletes_unused_ones(tmp_path: Path) -> None:
    """Regression: a cap of eight packages a step made the suite, whose tiny models have
    more decode layouts than that, delete and rebuild some on every run. Kept: every
    package used within UNUSED_DAYS, up to KEEP_PACKAGES; deleted: older ones (and their
    failure markers), dead partial builds; other steps' packages untouched."""
    now = time.time()

    def made(name: str, age_s: float) -> Path:
        path = tmp_path / name
        path.write_bytes(b"")
        os.utime(path, (now - age_s, now - age_s))
        return path

    recent = [made(f"step-{i:03d}.pt2", 100 + 60 * i) for i in range(20)]
    old = made("step-old.pt2", (ahead_of_time.UNUSED_DAYS + 1) * 86400)
    marker = made("step-old.failed", 0)
    partial = made(".step-dead.1.partial.pt2", 7200)
    other = made("other-old.pt2", (ahead_of_time.UNUSED_DAYS + 1) * 86400)
    ahead_of_time._prune(tmp_path, "step")
    assert all(p.exists() for p in recent) and other.exists()
    assert not old.exists() and not marker.exists() and not partial.exists()
    many = [made(f"step-x{i:03d}.pt2", i) for i in range(ahead_of_time.KEEP_PACKAGES)]
    ahead_of_time._prune(tmp_path, "step")
    kept = sorted(p.name for p in tmp_path.glob("step-*.pt2"))
    assert kept == sorted(p.name for p in many)  # the most recently used

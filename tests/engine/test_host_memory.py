"""The engine's host-allocator tuning: applied once on glibc, never over the user's own."""

from __future__ import annotations

import ctypes.util
import platform

import pytest

from hybridkv.engine import host_memory


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory, "_done", False)
    for name in host_memory._USER_TUNABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.skipif(
    platform.system() != "Linux" or ctypes.util.find_library("c") is None, reason="needs libc"
)
def test_tuned_once_on_glibc(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    libc_version = getattr(platform, "libc_ver", lambda: ("", ""))()[0]
    if libc_version != "glibc":
        pytest.skip("not glibc")
    assert host_memory.keep_freed_memory()
    calls: list[str] = []
    monkeypatch.setattr(host_memory.ctypes, "CDLL", lambda *a: calls.append("CDLL"))
    assert host_memory.keep_freed_memory()  # already done: libc not touched again
    assert not calls


def test_users_own_malloc_settings_stand(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    monkeypatch.setattr(
        host_memory.ctypes, "CDLL", lambda *a: pytest.fail("libc must not be loaded")
    )
    assert not host_memory.keep_freed_memory()


def test_no_libc_leaves_the_allocator_alone(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory.ctypes.util, "find_library", lambda name: None)
    assert not host_memory.keep_freed_memory()

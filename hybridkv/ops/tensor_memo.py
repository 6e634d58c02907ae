"""Values derived from long-lived tensors, remembered per tensor and forgotten with it.

The layer page views and the workspace's views live as long as their engine, and every
step derives the same things from them (their 16-byte-word rows, a K/V pair seen as one
tensor of rows): a few to a few dozen Python-level calls each time, in every layer. A memo
keyed by the tensors' identities answers in about a microsecond. Identity alone is not
enough (an id is reused once its tensor is freed), so each entry holds its tensors weakly
and is dropped when one of them is freed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from torch import Tensor

T = TypeVar("T")
_MISSING = object()


class TensorMemo(Generic[T]):
    """``derive()`` per (tensors, key), remembered while every one of the tensors lives."""

    def __init__(self) -> None:
        self._entries: dict[tuple[Hashable, ...], tuple[tuple[weakref.ref[Tensor], ...], T]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, tensors: tuple[Tensor, ...]) -> bool:
        """Whether anything is remembered for exactly these tensors (any key)."""
        ids = tuple(id(t) for t in tensors)
        return any(len(k) == len(ids) + 1 and k[:-1] == ids for k in self._entries)

    def lookup(self, tensors: tuple[Tensor, ...], key: Hashable = None) -> T | object:
        """The remembered value, or :data:`_MISSING`."""
        entry = self._entries.get((*(id(t) for t in tensors), key))
        if entry is not None and all(ref() is t for ref, t in zip(entry[0], tensors, strict=True)):
            return entry[1]
        return _MISSING

    def remember(self, tensors: tuple[Tensor, ...], value: T, key: Hashable = None) -> T:
        full = (*(id(t) for t in tensors), key)

        def forget(_: weakref.ref[Tensor]) -> None:
            self._entries.pop(full, None)

        self._entries[full] = (tuple(weakref.ref(t, forget) for t in tensors), value)
        return value

    def get(self, tensors: tuple[Tensor, ...], derive: Callable[[], T], key: Hashable = None) -> T:
        """The remembered value, else ``derive()`` remembered."""
        found = self.lookup(tensors, key)
        if found is not _MISSING:
            return found  # type: ignore[return-value]
        return self.remember(tensors, derive(), key)


def missing(value: object) -> bool:
    """Whether :meth:`TensorMemo.lookup` found nothing."""
    return value is _MISSING

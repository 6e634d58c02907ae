"""Fixtures of the ops tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import Tensor

from hybridkv.ops import ahead_of_time
from hybridkv.ops.compiled import CompiledOp
from hybridkv.ops.gated_delta_rule import mixer_decode


@pytest.fixture
def fresh_compile(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[CompiledOp[..., tuple[Tensor, ...]]]:
    """The GDN mixer's fused decode step with nothing compiled (or learnt to call directly)
    yet in the process, and nothing left behind (see test_gated_delta_rule); compiled just
    in time (no package loaded ahead of time at warm-up: tests/ops/test_ahead_of_time.py
    tests those)."""
    monkeypatch.setenv(ahead_of_time.CACHE_ENV, "off")
    op = mixer_decode._mixer_decode
    torch._dynamo.reset()
    op.reset()
    yield op
    torch._dynamo.reset()
    op.reset()

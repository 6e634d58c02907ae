"""Fixtures of the ops tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import Tensor

from hybridkv.ops.compiled import CompiledOp
from hybridkv.ops.gated_delta_rule import mixer_decode


@pytest.fixture
def fresh_compile() -> Iterator[CompiledOp[..., tuple[Tensor, ...]]]:
    """The GDN mixer's fused decode step with nothing compiled (or learnt to call directly)
    yet in the process, and nothing left behind (see test_gated_delta_rule)."""
    op = mixer_decode._mixer_decode
    torch._dynamo.reset()
    op.reset()
    yield op
    torch._dynamo.reset()
    op.reset()

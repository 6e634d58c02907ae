"""Gated delta rule (Gated DeltaNet's recurrence). State: [Hv, Dk, Dv] per layer, fp32 math.

Layers call :func:`gated_delta_rule_varlen`; the chunked and recurrent references are
exported for tests and for other layers. An FLA kernel would be dispatched here; none is
installed on CPU.
"""

from __future__ import annotations

from hybridkv.ops.gated_delta_rule.naive import (
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule,
)
from hybridkv.ops.gated_delta_rule.paged import gated_delta_rule_varlen

__all__ = [
    "chunk_gated_delta_rule",
    "gated_delta_rule_varlen",
    "l2norm",
    "recurrent_gated_delta_rule",
]

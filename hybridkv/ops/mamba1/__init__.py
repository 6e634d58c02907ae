"""Mamba1 selective-scan ops: prefill scan from a carried state, and one decode step.

Layers call :func:`selective_scan_varlen` (flat varlen batch, state pages read and written
in place, captures); :func:`selective_scan` and :func:`selective_state_update` are the
references it is tested against.

Dispatch: the plain-torch reference in :mod:`.naive` is the only backend today. mamba_ssm's
``selective_scan_fn`` (which takes no initial state) and ``selective_state_update`` would
plug in here behind the same signatures once installed and tested against the reference.
"""

from __future__ import annotations

from hybridkv.ops.mamba1.naive import selective_scan, selective_state_update
from hybridkv.ops.mamba1.paged import (
    SelectiveScanParams,
    selective_scan_varlen,
)

__all__ = [
    "SelectiveScanParams",
    "selective_scan",
    "selective_scan_varlen",
    "selective_state_update",
]

"""Mamba1 selective-scan ops: prefill scan from a carried state, and one decode step.

Dispatch: the plain-torch reference in :mod:`.naive` is the only backend today. mamba_ssm's
``selective_scan_fn`` (which takes no initial state) and ``selective_state_update`` would
plug in here behind the same signatures once installed and tested against the reference.
"""

from __future__ import annotations

from hybridkv.ops.mamba1.naive import selective_scan, selective_state_update

__all__ = ["selective_scan", "selective_state_update"]

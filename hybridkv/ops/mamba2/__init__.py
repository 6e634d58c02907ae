"""Mamba2 SSD ops: chunked prefill scan and one-step decode, both resuming from a state.

Layers call :func:`ssd_varlen` (flat varlen batch, state pages read and written in place,
captures); :func:`ssd_chunk_scan` and :func:`ssd_state_update` are the references it is
tested against.

Dispatch: the plain-torch reference in :mod:`.naive` is the only backend today. A fast
path (mamba_ssm's ``mamba_chunk_scan_combined`` / ``selective_state_update``) plugs in
here when that package is installed, behind the same signatures, and is tested against
the reference; it is not installed on our CPU machines, so none is wired yet.
"""

from __future__ import annotations

from hybridkv.ops.mamba2.naive import (
    NO_DT_LIMIT,
    DtLimit,
    discretize_dt,
    ssd_chunk_scan,
    ssd_state_update,
)
from hybridkv.ops.mamba2.paged import SSDParams, ssd_varlen

__all__ = [
    "NO_DT_LIMIT",
    "DtLimit",
    "SSDParams",
    "discretize_dt",
    "ssd_chunk_scan",
    "ssd_state_update",
    "ssd_varlen",
]

"""Mamba2 SSD ops: chunked prefill scan and one-step decode, both resuming from a state.

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

__all__ = ["NO_DT_LIMIT", "DtLimit", "discretize_dt", "ssd_chunk_scan", "ssd_state_update"]

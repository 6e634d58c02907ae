"""Depthwise causal conv1d with carried state, shared by GDN, Mamba1, Mamba2 and short conv.

Use :func:`causal_conv1d_varlen` from a layer (flat varlen batch, state pages read and
written in place, captures); :func:`causal_conv1d_fn` (chunk with an initial state) and
:func:`causal_conv1d_update` (one step, batched) are the references it is tested against.
The state is ``[C, K-1]`` channels-first, the last K-1 raw inputs (see ``naive.py``). A
``causal_conv1d`` package kernel would be dispatched here; none is installed on CPU.
"""

from __future__ import annotations

from hybridkv.ops.causal_conv1d.naive import causal_conv1d_fn, causal_conv1d_update
from hybridkv.ops.causal_conv1d.paged import causal_conv1d_varlen

__all__ = [
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "causal_conv1d_varlen",
]

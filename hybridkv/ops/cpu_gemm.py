"""Whether this machine multiplies bf16 / fp16 matrices natively, or emulates them.

On the CPU torch sends a bf16 or fp16 matmul to oneDNN's reduced-precision kernels only
where the CPU has the instructions they need (bf16: AVX-512 BW/VL/DQ, AVX-NE-CONVERT or
AMX; fp16: AVX-512 FP16 or AVX-NE-CONVERT); elsewhere, on a CPU with AVX2 alone, it runs
a portable loop that converts element by element. There a bf16 product is several times
slower than the same product in fp32. Measured on a 2-core AMD EPYC with AVX2 only (one
thread, ``F.linear`` of a 1,536 x 512 weight, 2026-11-26): bf16 9 GFLOP/s at 8, 64 and 512
rows, fp16 8, against fp32 31 / 64 / 42 (78-81 at 512 rows and more, the core's peak).
So the engine runs a bf16 model's matmuls in fp32 there (:mod:`hybridkv.layers.fp32_matmul`)
and its attention through SDPA rather than bf16 matmuls
(:mod:`hybridkv.ops.paged_attention.batched`).

torch's own answer to "would a reduced-precision matmul take oneDNN here" is
``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` (and its fp16 twin); it is read once.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _cpu_native(dtype: torch.dtype) -> bool:
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True  # fp32 and fp64 run BLAS kernels everywhere


def native_gemm(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether a ``dtype`` matmul on ``device`` runs a native kernel rather than an
    emulation far slower than fp32 (module doc). Devices other than the CPU: True."""
    if torch.device(device).type != "cpu":
        return True
    return _cpu_native(dtype)


__all__ = ["native_gemm"]

"""Which dtypes this machine multiplies natively: what torch itself would send to oneDNN."""

from __future__ import annotations

import torch

from hybridkv.ops.cpu_gemm import native_gemm


def test_fp32_is_native_everywhere() -> None:
    assert native_gemm(torch.float32)
    assert native_gemm(torch.float64, torch.device("cpu"))


def test_reduced_precision_follows_torchs_onednn_check() -> None:
    assert native_gemm(torch.bfloat16) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert native_gemm(torch.float16, "cpu") == torch.ops.mkldnn._is_mkldnn_fp16_supported()


def test_other_devices_are_taken_as_native() -> None:
    assert native_gemm(torch.bfloat16, "meta")
    assert native_gemm(torch.float16, torch.device("meta"))

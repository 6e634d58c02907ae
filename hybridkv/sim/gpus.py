"""Peak numbers of the GPUs the cost model knows (dense bf16 tensor FLOP/s, HBM bandwidth).

Values are the vendors' datasheet peaks for the SXM / flagship board of each part, dense
(no 2:4 sparsity), bf16 inputs with fp32 accumulation. The cost model scales them down
by an efficiency factor; they are upper bounds, not measurements.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Gpu:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes_per_s: float
    memory_bytes: int  # on the board (for display; the cache budget is given separately)


_GB = 10**9

GPUS: dict[str, Gpu] = {
    g.name.lower(): g
    for g in (
        # H100 SXM5: 989.4 TFLOP/s bf16 dense, 3.35 TB/s HBM3, 80 GB
        Gpu(name="H100", peak_flops=989.4e12, hbm_bytes_per_s=3.35e12, memory_bytes=80 * _GB),
        # H200 SXM: same compute as H100, 4.8 TB/s HBM3e, 141 GB
        Gpu(name="H200", peak_flops=989.4e12, hbm_bytes_per_s=4.8e12, memory_bytes=141 * _GB),
        # A100 SXM4 80 GB: 312 TFLOP/s bf16 dense, 2.039 TB/s HBM2e
        Gpu(name="A100", peak_flops=312e12, hbm_bytes_per_s=2.039e12, memory_bytes=80 * _GB),
        # L40S: 362 TFLOP/s bf16 dense, 864 GB/s GDDR6, 48 GB
        Gpu(name="L40S", peak_flops=362e12, hbm_bytes_per_s=864e9, memory_bytes=48 * _GB),
        # RTX 4090: 165 TFLOP/s bf16 dense with fp32 accumulation, 1008 GB/s GDDR6X, 24 GB
        Gpu(name="RTX4090", peak_flops=165.2e12, hbm_bytes_per_s=1008e9, memory_bytes=24 * _GB),
    )
}


def get_gpu(name: str) -> Gpu:
    """Look a GPU up by name, ignoring case, spaces and dashes ("rtx 4090" works).

    Raises:
        ValueError: an unknown name; the message lists the known ones.
    """
    key = name.lower().replace(" ", "").replace("-", "").replace("_", "")
    gpu = GPUS.get(key)
    if gpu is None:
        known = ", ".join(g.name for g in GPUS.values())
        raise ValueError(f"unknown GPU {name!r} (known: {known})")
    return gpu

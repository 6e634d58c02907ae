"""Do bf16 matmuls take this CPU's AVX-512 BF16 / AMX paths? fp32 against bf16 GEMM GFLOP/s.

Prints the CPU's matrix-relevant flags (lscpu: avx512_bf16, amx_bf16, amx_tile, ...),
torch's CPU capability and oneDNN (mkldnn) availability, then ``F.linear`` GFLOP/s in
fp32 and bf16 (and bf16/fp32) at the shapes the engine runs on the small Qwen3-Next of
vs_vllm_engine.py (hidden 512): M rows from one decode token to a 4096-token prefill step,
and the per-expert slices of its MoE (M of a few rows). When bf16 takes a native path it
runs at about 2x fp32 or better at large M; an emulated path (convert to fp32 and back) is
slower than fp32. Each figure is the best of ``--repeats`` timings of enough calls for
about ``--flops`` floating-point operations; the ratio column is the one to read on a
shared machine (both dtypes timed back to back). It also says what the engine's
``--cpu-matmul-dtype auto`` picks here (fp32 matmuls where bf16 is emulated). The "packed"
columns time the engine's CPU path, the weight laid out once for oneDNN
(``hybridkv.layers.packed_linear``), against plain ``F.linear`` on the same shape, back to
back ("nan": oneDNN cannot pack that dtype on this CPU).

Usage: ``python benchmarks/cpu_matmul_dtypes.py [--threads 1]``.
"""

from __future__ import annotations

import argparse
import subprocess
import time

import torch
import torch.nn.functional as F

from hybridkv.layers.packed_linear import PackedLinear
from hybridkv.ops.cpu_gemm import native_gemm

FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
# (M, K, N): decode/prefill rows through the model's projections and experts
SHAPES = [
    (1, 512, 512),
    (2, 512, 512),
    (8, 512, 512),
    (16, 512, 512),
    (64, 512, 512),
    (64, 512, 1536),
    (64, 256, 512),
    (512, 512, 1536),
    (4096, 512, 512),
    (4096, 512, 2048),
]


def cpu_flags() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "lscpu unavailable"
    model = next(
        (ln.split(":", 1)[1].strip() for ln in out.splitlines() if "Model name" in ln), "?"
    )
    flags = next((ln.split(":", 1)[1].split() for ln in out.splitlines() if "Flags" in ln), [])
    have = [f"{f}={'yes' if f in flags else 'no'}" for f in FLAGS]
    return f"{model}: " + " ".join(have)


def gflops(
    m: int, k: int, n: int, dtype: torch.dtype, flops: float, repeats: int, packed: bool = False
) -> float:
    """GFLOP/s of ``x [m, k] @ w [n, k].T`` (plain ``F.linear``, or the packed module)."""
    a = torch.randn(m, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    layer = PackedLinear.from_weight(w, None) if packed else None
    if packed and layer is None:
        return float("nan")  # oneDNN cannot pack this dtype here

    def run() -> torch.Tensor:
        return layer(a) if layer is not None else F.linear(a, w)

    run()  # warm-up: oneDNN picks and caches its kernel
    calls = max(3, int(flops / (2 * m * k * n)))
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                run()
            best = min(best, (time.perf_counter() - start) / calls)
    return 2 * m * k * n / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--flops", type=float, default=2e9, help="work per timing (default 2e9)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_flags())
    print(
        f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
        f"mkldnn {'available' if torch.backends.mkldnn.is_available() else 'absent'}, "
        f"{args.threads} thread(s); best of {args.repeats}"
    )
    native = native_gemm(torch.bfloat16)
    print(
        f"bf16 matmuls {'native' if native else 'emulated'} here: --cpu-matmul-dtype auto "
        f"runs a bf16 model's matmuls in {'bf16' if native else 'fp32'} "
        "(hybridkv.layers.fp32_matmul)"
    )
    header = ("M", "K", "N", "fp32", "bf16", "bf16/fp32", "fp32 packed", "bf16 packed")
    print("GFLOP/s; packed: the engine's pre-packed weight, and its speed-up over plain")
    print("{:>6s} {:>5s} {:>5s} {:>8s} {:>8s} {:>10s} {:>18s} {:>18s}".format(*header))
    for m, k, n in SHAPES:
        f32 = gflops(m, k, n, torch.float32, args.flops, args.repeats)
        b16 = gflops(m, k, n, torch.bfloat16, args.flops, args.repeats)
        f32p = gflops(m, k, n, torch.float32, args.flops, args.repeats, packed=True)
        b16p = gflops(m, k, n, torch.bfloat16, args.flops, args.repeats, packed=True)
        print(
            f"{m:6d} {k:5d} {n:5d} {f32:8.1f} {b16:8.1f} {b16 / f32:9.2f}x "
            f"{f32p:9.1f} ({f32p / f32:4.2f}x) {b16p:9.1f} ({b16p / b16:4.2f}x)"
        )


if __name__ == "__main__":
    main()

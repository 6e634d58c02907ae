"""SSM state dtype per model family: greedy agreement with an fp32-state reference, and capacity.

A bf16 model can keep its recurrent (SSM) state in bf16 or in fp32
(``--mamba-ssm-cache-dtype``). This script measures both sides of that choice:

- **Agreement.** For each family, the tests' tiny random checkpoint
  (``tests/engine/engine_checkpoints.py``: Qwen3-Next and Qwen3.5 = Gated DeltaNet;
  Nemotron-H, Bamba, Granite-4.0-H, Falcon-H1, Zamba2 = Mamba2; Jamba = Mamba1; LFM2 =
  short conv) runs on the engine in bf16 with the SSM state in fp32 (the reference) and in
  bf16, greedy, ``--tokens`` tokens after each of ``--prompts`` random prompts (EOS
  ignored); with ``--state-shapes real`` (the default) each family's per-head state
  shape is the published model's (``REAL_STATE_SHAPES``), ``tests`` keeps the tests'
  smaller ones. Printed per family: tokens until the first divergence (median and min over the
  prompts), the fraction of positions with the same token, and how many prompts agree to
  the end. For scale, the same columns for the fp32 model (fp32 everything) against the
  same reference: what bf16 weights alone change. Only the SSM state changes dtype (the
  conv state stays in the model dtype), so LFM2, whose only state is a short conv, must
  agree everywhere: a check that the flag touches nothing else.
- **Capacity.** ``hybridkv plan`` on built-in model configs (``hybridkv plan --list``) with
  the SSM state as ``auto`` resolves it, in fp32 and in bf16: state bytes per sequence, KV
  tokens left beside ``--max-num-seqs`` live states and sequences of ``--max-model-len`` at
  once, in ``--memory-gib``.

The random tiny models are not trained models: their logits are peaky (initializer 0.1,
few near-ties), so these agreements bound what the dtype changes in a forward; a trained
model's near-ties make it more sensitive. The ``auto`` column is what
``--mamba-ssm-cache-dtype auto`` resolves to for a bf16 model of that family.

Usage: ``python benchmarks/ssm_state_dtype.py [--tokens 256] [--prompts 8]
[--archs qwen3_next jamba] [--skip-capacity]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from engine_common import ROOT, machine_line

from hybridkv import LLM, SamplingParams
from hybridkv.core.families import FAMILIES
from hybridkv.core.model_config import flatten_text_config, resolve_dtypes

FAMILY_OF = {
    "qwen3_next": "GDN",
    "qwen3_5_text": "GDN",
    "nemotron_h": "Mamba2",
    "bamba": "Mamba2",
    "granitemoehybrid": "Mamba2",
    "falcon_h1": "Mamba2",
    "zamba2": "Mamba2",
    "jamba": "Mamba1",
    "lfm2": "short conv",
}
# --state-shapes real: each family's published per-head state shape (GDN k/v head dims of
# Qwen3-Next; d_state of Nemotron-H, Bamba, Granite-4.0-H, Falcon-H1-7B, Zamba2, Jamba;
# Nemotron-H's head dim) on the tiny models' few heads and hidden size 64: the dimensions a
# state's update and read-out sum over, where its rounding error grows.
REAL_STATE_SHAPES: dict[str, dict[str, int]] = {
    "qwen3_next": {"linear_key_head_dim": 128, "linear_value_head_dim": 128},
    "qwen3_5_text": {"linear_key_head_dim": 128, "linear_value_head_dim": 128},
    "nemotron_h": {"mamba_head_dim": 64, "ssm_state_size": 128},
    "bamba": {"mamba_d_state": 128},
    "granitemoehybrid": {"mamba_d_state": 128},
    "falcon_h1": {"mamba_d_state": 256},
    "zamba2": {"mamba_d_state": 64},
    "jamba": {"mamba_d_state": 16},
    "lfm2": {},
}
CAPACITY_CONFIGS = [
    "qwen3-next-80b-a3b-instruct",
    "qwen3.5-0.8b",
    "qwen3.5-27b",
    "nemotron-h-8b-base-8k",
    "nvidia-nemotron-nano-9b-v2",
    "granite-4.0-h-tiny",
    "bamba-9b",
    "falcon-h1-7b",
    "zamba2-7b",
    "ai21-jamba-1.5-mini",
    "kimi-linear-48b-a3b-instruct",
    "lfm2-1.2b",
]


def greedy(
    path: Path, dtype: str, ssm_dtype: str, prompts: list[list[int]], tokens: int
) -> list[list[int]]:
    llm = LLM(
        str(path),
        dtype=dtype,
        mamba_ssm_cache_dtype=ssm_dtype,
        cache_memory_gib=0.1,
        max_model_len=max(map(len, prompts)) + tokens + 16,
        max_num_seqs=len(prompts),
    )
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)  # type: ignore[arg-type]
    return [list(o.outputs[0].token_ids) for o in outs]


def first_divergence(a: list[int], b: list[int]) -> int:
    """Tokens equal before the first difference (len if none)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def agreement(runs: list[list[int]], reference: list[list[int]]) -> str:
    firsts = [first_divergence(a, b) for a, b in zip(runs, reference, strict=True)]
    equal = sum(
        x == y for a, b in zip(runs, reference, strict=True) for x, y in zip(a, b, strict=True)
    )
    total = sum(map(len, reference))
    full = sum(f == len(r) for f, r in zip(firsts, reference, strict=True))
    return (
        f"{statistics.median(firsts):6.0f} {min(firsts):5d} {equal / total:7.1%} "
        f"{full:3d}/{len(reference)}"
    )


def auto_ssm_dtype(path: Path) -> str:
    """What 'auto' resolves to for a bf16 model of this checkpoint (the loader's rule)."""
    cfg = flatten_text_config(json.loads((path / "config.json").read_text()))
    family = FAMILIES[str(cfg["model_type"])]
    return resolve_dtypes({**cfg, "dtype": "bfloat16"}, family, conv_dtype="bfloat16").ssm


def report_agreement(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "models"))
    sys.path.insert(0, str(ROOT / "tests" / "engine"))
    import engine_checkpoints

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(256) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
    print(
        f"\ngreedy agreement with the bf16 model + fp32 SSM state, {args.prompts} prompts of "
        f"{args.prompt_tokens} random tokens, {args.tokens} tokens each; state shapes: "
        f"{args.state_shapes}"
    )
    print(
        f"  {'model (family)':30s} {'auto':>8s} | "
        f"{'bf16 state: 1st diff med/min, equal, full':>41s} | {'fp32 model: same':>27s}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs:
            path = Path(tmp) / arch
            path.mkdir()
            if args.state_shapes == "real":  # build_checkpoint reads its module's CONFIGS
                engine_checkpoints.CONFIGS[arch] = {
                    **engine_checkpoints.CONFIGS[arch],
                    **REAL_STATE_SHAPES[arch],
                }
            engine_checkpoints.build_checkpoint(arch, path)
            reference = greedy(path, "bfloat16", "float32", prompts, args.tokens)
            bf16_state = greedy(path, "bfloat16", "bfloat16", prompts, args.tokens)
            fp32_model = greedy(path, "float32", "float32", prompts, args.tokens)
            auto = "-" if FAMILY_OF[arch] == "short conv" else auto_ssm_dtype(path)  # no SSM state
            print(
                f"  {arch + ' (' + FAMILY_OF[arch] + ')':30s} {auto:>8s} | "
                f"{agreement(bf16_state, reference):>41s} | "
                f"{agreement(fp32_model, reference):>27s}",
                flush=True,
            )


def plan(config: str, ssm_dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [
        *(sys.executable, "-c", "from hybridkv.cli import main; main()", "plan", config),
        *("--memory-gib", str(args.memory_gib), "--max-model-len", str(args.max_model_len)),
        *("--max-num-seqs", str(args.max_num_seqs)),
        *(() if ssm_dtype == "auto" else ("--ssm-dtype", ssm_dtype)),
        "--json",
    ]
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=os.environ)
    return dict(json.loads(out.stdout))


def count(value: int | None) -> str:
    return "-" if value is None else f"{value:,d}"


def report_capacity(args: argparse.Namespace) -> None:
    print(
        f"\ncapacity (`hybridkv plan CONFIG --memory-gib {args.memory_gib:g} --max-model-len "
        f"{args.max_model_len} --max-num-seqs {args.max_num_seqs} --ssm-dtype D --json`): state "
        f"per sequence, KV tokens beside the {args.max_num_seqs} live states, sequences of "
        f"{args.max_model_len} at once"
    )
    print(
        f"  {'config':30s} {'auto':>8s} {'state MiB fp32':>14s} {'bf16':>7s} "
        f"{'KV tokens fp32':>14s} {'bf16':>9s} {'seqs fp32':>9s} {'bf16':>5s}"
    )
    for name in args.configs:
        auto, fp32, bf16 = (plan(name, d, args) for d in ("auto", "float32", "bfloat16"))
        auto_dtype = (
            "float32" if auto["state_bytes_per_seq"] == fp32["state_bytes_per_seq"] else "bfloat16"
        )
        if fp32["state_bytes_per_seq"] == bf16["state_bytes_per_seq"]:
            auto_dtype = "-"  # no SSM state (short conv only)
        print(
            f"  {name:30s} {auto_dtype:>8s} {fp32['state_bytes_per_seq'] / 2**20:14.2f} "
            f"{bf16['state_bytes_per_seq'] / 2**20:7.2f} {count(fp32['kv_capacity_tokens']):>14s} "
            f"{count(bf16['kv_capacity_tokens']):>9s} {fp32['max_concurrency']:9d} "
            f"{bf16['max_concurrency']:5d}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=256, help="greedy tokens per prompt")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument(
        "--state-shapes",
        choices=("real", "tests"),
        default="real",
        help="per-head state dims: the published models' or the test suite's tiny ones",
    )
    parser.add_argument("--archs", nargs="+", default=list(FAMILY_OF), choices=list(FAMILY_OF))
    parser.add_argument("--configs", nargs="+", default=CAPACITY_CONFIGS, help="built-in names")
    parser.add_argument("--memory-gib", type=float, default=16.0)
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--max-num-seqs", type=int, default=64, help="live states reserved")
    parser.add_argument("--skip-capacity", action="store_true")
    parser.add_argument("--skip-agreement", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {machine_line()}")
    if not args.skip_agreement:
        report_agreement(args)
    if not args.skip_capacity:
        report_capacity(args)


if __name__ == "__main__":
    main()

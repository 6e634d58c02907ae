"""Peak host memory and time of loading a real-shape checkpoint: hybridkv against transformers.

Target (issue #15): peak RSS while loading <= 1.25 x the checkpoint's bytes in the target
dtype + 300 MB, and load time <= transformers' ``from_pretrained``. The checkpoint is
Qwen3.5-0.8B's published shape with random weights in bf16, built here with transformers
(once, outside the checkout) from ``../shared/model_configs/qwen3.5-0.8b.json``.

Each load runs in a fresh subprocess, ours and transformers' interleaved, so both see the
same machine load; the figures are medians. Peak RSS is the process's ``VmHWM`` (imports
included, as a user would see it); "delta" subtracts the RSS measured just before loading.
Weights may stay mapped from the safetensors file until first read, so the peak is also
taken after reading one element per page of every weight ("touched", as a first forward
would): that is the figure the target is checked against.

    python benchmarks/load_memory.py --checkpoint /tmp/qwen35-08b-bf16 [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

MIB = 1 << 20
CONFIG_NAME = "shared/model_configs/qwen3.5-0.8b.json"
# the nearest ancestor that has it: from /work/main and from a worktree in /work/wt/<name>
DEFAULT_CONFIG = next(
    (p / CONFIG_NAME for p in Path(__file__).resolve().parents if (p / CONFIG_NAME).is_file()),
    Path(__file__).resolve().parents[2] / CONFIG_NAME,
)

CHILD = """
import json, sys, time
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
import torch
torch.set_num_threads(1)
{imports}
before = rss("VmRSS")
start = time.perf_counter()
{load}
seconds = time.perf_counter() - start
loaded = rss("VmHWM")
# read one element per page of every weight, so weights still mapped from the file count too
# (oneDNN-packed weights are opaque and were written while packing: already resident)
for t in model.state_dict().values():
    if not t.is_mkldnn:
        t.detach().reshape(-1)[::1024].float().sum()
print(json.dumps({{"seconds": seconds, "peak": loaded, "touched": rss("VmHWM"), "before": before}}))
"""
LOADERS = {
    "hybridkv": (  # bf16 weights (issue 15's target) even on a CPU that emulates bf16
        "from hybridkv.models.loader import load_model",
        "model = load_model(sys.argv[1], 'bfloat16', matmul_dtype='model').model",
    ),
    "hybridkv fp32 matmuls": (  # --cpu-matmul-dtype float32 (auto on an AVX2-only CPU)
        "from hybridkv.models.loader import load_model",
        "model = load_model(sys.argv[1], 'bfloat16', matmul_dtype='float32').model",
    ),
    "hybridkv packed": (  # --pack-weights: the oneDNN-packed linears, read unmapped
        "from hybridkv.models.loader import load_model",
        "model = load_model(sys.argv[1], 'bfloat16', pack_weights=True,"
        " matmul_dtype='model').model",
    ),
    "transformers": (
        "from transformers import AutoModelForCausalLM",
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)",
    ),
}


def build_checkpoint(config_path: Path, out: Path) -> None:
    """A random bf16 Qwen3.5 text checkpoint with the published config's shapes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    published = json.loads(config_path.read_text())
    fields = {
        k: v
        for k, v in published.items()
        if not k.startswith("_") and "." not in k and k not in ("model_type", "total_params")
    }
    config = AutoConfig.for_model("qwen3_5_text", **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)


def measure(name: str, checkpoint: Path) -> dict[str, Any]:
    imports, load = LOADERS[name]
    code = CHILD.format(imports=imports, load=load)
    done = subprocess.run(
        [sys.executable, "-c", code, str(checkpoint)], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="built here if absent")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not (args.checkpoint / "config.json").is_file():
        print(f"building {args.checkpoint} from {args.config} ...", file=sys.stderr)
        build_checkpoint(args.config, args.checkpoint)
    size = sum(p.stat().st_size for p in args.checkpoint.glob("*.safetensors"))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in LOADERS}
    for _ in range(args.repeats):
        for name in LOADERS:
            runs[name].append(measure(name, args.checkpoint))
    target = 1.25 * size + 300 * MIB
    print(f"checkpoint {size / MIB:,.0f} MiB (bf16); target peak <= {target / MIB:,.0f} MiB")
    summary = {}
    for name, results in runs.items():
        peak = statistics.median(r["peak"] for r in results)
        delta = statistics.median(r["peak"] - r["before"] for r in results)
        seconds = statistics.median(r["seconds"] for r in results)
        touched = statistics.median(r["touched"] for r in results)
        summary[name] = {"peak_mib": touched / MIB, "seconds": seconds}
        print(
            f"{name:>15}: peak RSS {peak / MIB:,.0f} MiB after loading (+{delta / MIB:,.0f} MiB "
            f"over the pre-load RSS), {touched / MIB:,.0f} MiB once every weight is read; "
            f"load {seconds:.2f} s  [median of {len(results)}]"
        )
    theirs = summary["transformers"]
    for name in ("hybridkv", "hybridkv packed"):
        ours = summary[name]
        print(
            f"{name}/transformers: peak {ours['peak_mib'] / theirs['peak_mib']:.2f}x, "
            f"time {ours['seconds'] / theirs['seconds']:.2f}x; peak (weights read) target "
            f"{'met' if ours['peak_mib'] * MIB <= target else 'MISSED'}"
        )


if __name__ == "__main__":
    main()

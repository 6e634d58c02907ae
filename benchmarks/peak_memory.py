"""Peak host memory of the engine on issue 13's W1 and W3, and where it sits.

Issue 13 asks for no more peak memory than before its changes, but one run's peak says
little: identical W1 runs of the small Qwen3-Next read 804-906 MiB (2026-11-26). So each
run here is a fresh process (imports included, as a server starts), run ``--runs`` times;
with ``--against REF`` the same runs of a git worktree at REF alternate with this
checkout's, and the per-pair difference is reported beside both medians.

A run builds the engine as ``vs_vllm_engine.py``'s hybridkv side does (bf16, 1 GiB cache,
max_num_seqs 64, max_num_batched_tokens 4096, one thread), serves a warm-up and one
workload, and reads ``/proc/self/status`` (VmHWM, VmRSS) after each phase and
``/proc/self/smaps`` at the end: the brk heap (glibc's main arena: most tensors the
forward frees stay there), the largest anonymous mapping (the cache arena, resident as
far as pages were touched) and all anonymous memory:

    W1   64 x 128-token prompts, 64 tokens out
    W3   32 x (one shared 1,500-token prefix + 50 tokens), 16 tokens out

Usage: ``python benchmarks/peak_memory.py [--workload w1] [--runs 5] [--against REF]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from pathlib import Path

PHASES = ("imported", "engine", "warm-up", "workload")
AT_END = ("heap", "arena", "anonymous")


# ----------------------------------------------------------------------------- child side
def status_mib() -> dict[str, int]:
    """VmHWM and VmRSS of this process, MiB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmHWM", "VmRSS"):
            out[key] = int(line.split()[1]) // 1024
    return out


def smaps_mib() -> dict[str, int]:
    """Resident MiB of the brk heap, the largest anonymous mapping, all anonymous ones."""
    maps: list[tuple[str, int]] = []
    name = ""
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            name = fields[5] if len(fields) > 5 else ""
        elif fields and fields[0] == "Rss:":
            maps.append((name, int(fields[1])))
    anonymous = [kb for name, kb in maps if name == ""]
    return {
        "heap": sum(kb for name, kb in maps if name == "[heap]") // 1024,
        "arena": max(anonymous, default=0) // 1024,
        "anonymous": (sum(anonymous) + sum(kb for n, kb in maps if n == "[heap]")) // 1024,
    }


def prompts(workload: str, vocab: int, seed: int) -> tuple[list[list[int]], int]:
    """The workload's prompts (fresh random ids, ids 3.. avoid the special tokens) and
    its output length."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    if workload == "w1":
        return [ids(128) for _ in range(64)], 64
    prefix = ids(1500)
    return [prefix + ids(50) for _ in range(32)], 16


def child(args: argparse.Namespace) -> None:
    phases: dict[str, dict[str, int]] = {}
    import torch

    torch.set_num_threads(1)
    from hybridkv import LLM, SamplingParams

    phases["imported"] = status_mib()
    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        max_model_len=4096,
        max_num_seqs=64,
        cache_memory_gib=1.0,
        max_num_batched_tokens=4096,
        seed=args.seed,
    )
    phases["engine"] = status_mib()
    vocab = llm.engine.vocab_size
    warm = [[random.Random(12345 + i).randrange(3, vocab) for _ in range(32)] for i in range(4)]
    done = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in warm], done, use_tqdm=False)
    phases["warm-up"] = status_mib()
    batch, max_tokens = prompts(args.child, vocab, args.seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    phases["workload"] = status_mib()
    print(json.dumps({"memory": {"phases": phases, "end": smaps_mib()}}), flush=True)


# ----------------------------------------------------------------------------- parent side
def run_child(code: Path, args: argparse.Namespace, model: str, seed: int, log: Path) -> dict:
    """One fresh process of the checkout at ``code`` (its package first on the path); its
    stderr goes to ``log``."""
    from anchors_common import json_line, run_logged

    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", args.workload]
    cmd += ["--model", model, "--seed", str(seed)]
    env = {**os.environ, "PYTHONPATH": str(code)}
    try:
        return json_line(run_logged(cmd, log, env=env, timeout_s=args.timeout), '{"memory":')[
            "memory"
        ]
    except RuntimeError as e:
        tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-5:])
        sys.exit(f"run of {code}: {e}\n{tail}")


def figures(run: dict) -> dict[str, int]:
    """Each phase's peak so far (VmHWM) and the end's mappings, MiB."""
    out = {f"peak after {p}": run["phases"][p]["VmHWM"] for p in PHASES}
    out.update({f"{k} at the end": run["end"][k] for k in AT_END})
    return out


def print_table(runs: dict[str, list[dict[str, int]]]) -> None:
    """Median [min-max] per figure and side; with two sides, the per-pair difference."""

    def spread(values: list[int]) -> str:
        return f"{statistics.median(values):,.0f} [{min(values):,}-{max(values):,}]"

    sides = list(runs)
    header = "".join(f"{side:>24s}" for side in sides)
    extra = f"{'difference per pair':>24s}" if len(sides) == 2 else ""
    print(f"\nMiB, median [min-max] over the runs\n  {'':24s}{header}{extra}")
    for key in runs[sides[0]][0]:
        cells = "".join(f"{spread([r[key] for r in runs[side]]):>24s}" for side in sides)
        if len(sides) == 2:
            diffs = [a[key] - b[key] for a, b in zip(*runs.values(), strict=True)]
            cells += f"{spread(diffs):>24s}"
        print(f"  {key:24s}{cells}")


def parent(args: argparse.Namespace) -> None:
    from anchors_common import checkouts, data_dir, machine_line
    from vs_vllm_engine import small_model

    model = str(small_model(args.model, args.anchors_dir, args.data_dir))
    logs = data_dir(args.data_dir, "peak_memory")
    print(f"machine: {machine_line()}")
    print(f"{args.workload}, {args.runs} fresh process(es) a side; model {model}; logs in {logs}")
    with checkouts(args.against) as codes:
        runs: dict[str, list[dict[str, int]]] = {side: [] for side in codes}
        for r in range(args.runs):
            order = list(codes) if r % 2 == 0 else list(codes)[::-1]
            for n, side in enumerate(order):
                log = logs / f"run{r}-{n}.log"
                runs[side].append(figures(run_child(codes[side], args, model, args.seed + r, log)))
                print(
                    f"  run {r} {side}: peak {runs[side][-1]['peak after workload']:,} MiB",
                    flush=True,
                )
    print_table(runs)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=("w1", "w3"), default="w1")
    p.add_argument("--runs", type=int, default=5, help="fresh processes a side (at least 1)")
    p.add_argument("--against", help="a commit to compare with, run from a git worktree")
    p.add_argument("--seed", type=int, default=0, help="prompt seed of run 0 (+1 each)")
    p.add_argument("--model", help="an existing checkpoint instead of the cached small one")
    p.add_argument("--anchors-dir", help="shared/anchors, to build the model once")
    p.add_argument("--data-dir", help="logs and the checkpoint cache ($HYBRIDKV_ANCHORS_DATA)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per process at most")
    p.add_argument("--child", choices=("w1", "w3"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.runs < 1:
        p.error("--runs must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()

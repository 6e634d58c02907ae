"""Output tokens/s of the engine on 64 requests, against transformers' ``generate``.

One tiny random Qwen3.5 checkpoint (tests/models/tiny.py) is built with transformers in a
temp dir; the same prompts go to

- transformers ``generate``, static batching: fixed batches of ``--hf-batch-size``
  requests, each batch decoding until its longest request is done;
- hybridkv's engine (continuous batching, every request stops at its own length), with
  prefix caching on (the default) and off.

transformers 5 gives wrong logits for left-padded prompts on this hybrid model (the GDN
layers' cached path; checked below on every run), so all prompts have the same length and
no batch is padded. Two output-length mixes are timed: all equal (decoding cost alone) and
uniform in [8, 2 x mean] (what static batching wastes on short requests). Greedy, EOS
ignored, so both sides generate exactly the requested tokens; the engine's tokens are
compared with transformers'.

Each repeat draws fresh prompts (a prompt never repeats across runs, so caching on finds
nothing to reuse but what the prompts share by chance: its cost, not its gain, is measured)
and runs transformers, the engine with caching on and with caching off on them in a rotated
order, after a warm-up. Printed: tokens/s as median [min-max] over the repeats, the
ratios taken per repeat (same prompts, side by side) then their median, and the
load-independent columns beside them: engine steps, prompt tokens computed and prompt
tokens served from the cache (per run; a "~" marks one that varied across repeats).

Usage: ``python benchmarks/engine_throughput.py [--num-requests 64] [--repeats 5] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from engine_common import build_tiny_checkpoint, machine_line

from hybridkv import LLM, SamplingParams


def hf_generate(model: Any, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """One static batch (equal-length prompts, no padding): greedy, EOS off."""
    ids = torch.tensor(prompts)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
            eos_token_id=[],
            pad_token_id=0,
        )
    return out[:, ids.shape[1] :].tolist()


def run_hf(model: Any, prompts: list[list[int]], lengths: list[int], batch_size: int) -> Run:
    """(seconds, each request's tokens cut to its length) for static batches in order."""
    tokens: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch_lengths = lengths[i : i + batch_size]
        out = hf_generate(model, prompts[i : i + batch_size], max(batch_lengths))
        tokens += [row[:n] for row, n in zip(out, batch_lengths, strict=True)]
    return Run(seconds=time.perf_counter() - start, tokens=tokens)


@dataclass(frozen=True, slots=True)
class Run:
    """One timed run: its seconds, each request's tokens, and the load-free counts."""

    seconds: float
    tokens: list[list[int]]
    steps: int = 0
    computed: int = 0  # prompt tokens the forward ran (not served from the cache)
    cached: int = 0  # prompt tokens served from the cache
    preemptions: int = 0


def run_engine(llm: LLM, prompts: list[list[int]], lengths: list[int]) -> Run:
    batch = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    before = llm.stats()
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)  # type: ignore[arg-type]
    seconds = time.perf_counter() - start
    after = llm.stats()
    cached = sum(o.num_cached_tokens for o in outs)
    return Run(
        seconds=seconds,
        tokens=[o.outputs[0].token_ids for o in outs],
        steps=after["num_steps"] - before["num_steps"],
        computed=sum(map(len, prompts)) - cached,
        cached=cached,
        preemptions=after["num_preemptions"] - before["num_preemptions"],
    )


def check_padding(model: Any, rng: random.Random) -> str:
    """How far transformers' left-padded batch is from the same prompts decoded alone."""
    prompts = [[rng.randrange(256) for _ in range(rng.randint(16, 64))] for _ in range(8)]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    options: dict[str, Any] = {
        "max_new_tokens": 3,
        "do_sample": False,
        "eos_token_id": [],
        "pad_token_id": 0,
        "output_logits": True,
        "return_dict_in_generate": True,
    }
    with torch.no_grad():
        padded = torch.stack(model.generate(ids, attention_mask=mask, **options).logits, 1)
        errors = [
            (torch.stack(model.generate(torch.tensor([p]), **options).logits, 1)[0] - padded[i])
            .abs()
            .max()
            .item()
            for i, p in enumerate(prompts)
        ]
    wrong = sum(e > 1e-3 for e in errors)
    return (
        f"{wrong}/{len(prompts)} left-padded prompts get logits off by > 1e-3 "
        f"(max {max(errors):.2g}) against the same prompt alone"
    )


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    """'median [min-max]' of ``values``."""
    return (
        f"{fmt.format(statistics.median(values))} "
        f"[{fmt.format(min(values))}-{fmt.format(max(values))}]"
    )


def same_in_every_run(values: list[int]) -> str:
    """The count, or its median marked '~' if the repeats did not all agree."""
    if all(v == values[0] for v in values):
        return str(values[0])
    return f"~{statistics.median(values):g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--mean-output-tokens", type=int, default=32)
    parser.add_argument("--hf-batch-size", type=int, default=64, help="static batch size")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (both sides)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        hf_model, path = build_tiny_checkpoint(Path(tmp))
        print(f"machine: {machine_line()}")
        print(f"transformers padding check: {check_padding(hf_model, rng)}; prompts unpadded")
        mean = args.mean_output_tokens
        mixes = {
            "equal": [mean] * args.num_requests,
            "varied": [rng.randint(8, 2 * mean - 8) for _ in range(args.num_requests)],
        }
        engines = {
            "cache on": LLM(str(path), max_num_seqs=args.num_requests, cache_memory_gib=0.5),
            "cache off": LLM(
                str(path),
                max_num_seqs=args.num_requests,
                cache_memory_gib=0.5,
                enable_prefix_caching=False,
            ),
        }
        warm = [[rng.randrange(256) for _ in range(16)] for _ in range(4)], [4] * 4
        for llm in engines.values():
            run_engine(llm, *warm)
        run_hf(hf_model, *warm, batch_size=4)
        print(
            f"{args.num_requests} requests of {args.prompt_tokens} prompt tokens, greedy; "
            f"transformers static batches of {args.hf_batch_size}; {args.repeats} repeats, "
            "fresh prompts each, sides interleaved"
        )
        for mix, lengths in mixes.items():
            report_mix(mix, lengths, rng, hf_model, engines, args)


def report_mix(
    mix: str,
    lengths: list[int],
    rng: random.Random,
    hf_model: Any,
    engines: dict[str, LLM],
    args: argparse.Namespace,
) -> None:
    sides: list[str] = ["transformers", *engines]
    runs: dict[str, list[Run]] = {side: [] for side in sides}
    same: dict[str, int] = dict.fromkeys(engines, 0)
    for i in range(args.repeats):
        prompts = [
            [rng.randrange(256) for _ in range(args.prompt_tokens)]
            for _ in range(args.num_requests)
        ]
        shift = i % len(sides)
        for side in sides[shift:] + sides[:shift]:
            if side == "transformers":
                run = run_hf(hf_model, prompts, lengths, args.hf_batch_size)
            else:
                run = run_engine(engines[side], prompts, lengths)
            runs[side].append(run)
        for label in engines:
            hf_tokens = runs["transformers"][-1].tokens
            tokens = runs[label][-1].tokens
            same[label] += sum(a == b for a, b in zip(tokens, hf_tokens, strict=True))
    useful = sum(lengths)
    total = args.repeats * len(lengths)
    hf_runs = runs["transformers"]
    print(f"\noutput lengths {mix} (mean {useful / len(lengths):.1f}, {useful} tokens)")
    print(
        f"  {'':34s} {'tok/s median [min-max]':>24s} {'vs transformers':>17s} "
        f"{'steps':>5s} {'computed':>8s} {'cached':>6s} {'preempt':>7s}"
    )
    hf_rates = spread([useful / r.seconds for r in hf_runs], "{:.1f}")
    print(f"  {'transformers generate (static)':34s} {hf_rates:>24s}")
    for label in engines:
        rs = runs[label]
        vs_hf = [h.seconds / r.seconds for r, h in zip(rs, hf_runs, strict=True)]
        print(
            f"  {'hybridkv engine, ' + label:34s} "
            f"{spread([useful / r.seconds for r in rs], '{:.1f}'):>24s} {spread(vs_hf):>17s} "
            f"{same_in_every_run([r.steps for r in rs]):>5s} "
            f"{same_in_every_run([r.computed for r in rs]):>8s} "
            f"{same_in_every_run([r.cached for r in rs]):>6s} "
            f"{same_in_every_run([r.preemptions for r in rs]):>7s}"
            f"  {same[label]}/{total} outputs identical to transformers'"
        )
    on_off = [
        off.seconds / on.seconds
        for on, off in zip(runs["cache on"], runs["cache off"], strict=True)
    ]
    print(f"  prefix caching on / off (throughput, per repeat): {spread(on_off)}")


if __name__ == "__main__":
    main()

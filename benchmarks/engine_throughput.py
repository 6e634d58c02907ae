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
compared with transformers'. Each figure is the best of ``--repeats`` runs, after a warm-up.

Usage: ``python benchmarks/engine_throughput.py [--num-requests 64] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
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


def run_hf(
    model: Any, prompts: list[list[int]], lengths: list[int], batch_size: int
) -> tuple[float, list[list[int]]]:
    """(seconds, each request's tokens cut to its length) for static batches in order."""
    tokens: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch_lengths = lengths[i : i + batch_size]
        out = hf_generate(model, prompts[i : i + batch_size], max(batch_lengths))
        tokens += [row[:n] for row, n in zip(out, batch_lengths, strict=True)]
    return time.perf_counter() - start, tokens


def run_engine(
    llm: LLM, prompts: list[list[int]], lengths: list[int]
) -> tuple[float, list[list[int]]]:
    batch = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)  # type: ignore[arg-type]
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


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


def best_of(repeats: int, fn: Any, *args: Any) -> tuple[float, list[list[int]]]:
    runs = [fn(*args) for _ in range(repeats)]
    return min(runs, key=lambda r: r[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--mean-output-tokens", type=int, default=32)
    parser.add_argument("--hf-batch-size", type=int, default=64, help="static batch size")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (both sides)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        hf_model, path = build_tiny_checkpoint(Path(tmp))
        print(f"machine: {machine_line()}")
        print(f"transformers padding check: {check_padding(hf_model, rng)}; prompts unpadded")
        prompts = [
            [rng.randrange(256) for _ in range(args.prompt_tokens)]
            for _ in range(args.num_requests)
        ]
        mean = args.mean_output_tokens
        mixes = {
            "equal": [mean] * len(prompts),
            "varied": [rng.randint(8, 2 * mean - 8) for _ in prompts],
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
        warm = prompts[:4], [4] * 4
        for llm in engines.values():
            run_engine(llm, *warm)
        run_hf(hf_model, *warm, batch_size=4)
        print(
            f"{args.num_requests} requests of {args.prompt_tokens} prompt tokens, greedy; "
            f"transformers static batches of {args.hf_batch_size}; best of {args.repeats}"
        )
        for mix, lengths in mixes.items():
            report_mix(mix, lengths, prompts, hf_model, engines, args)


def report_mix(
    mix: str,
    lengths: list[int],
    prompts: list[list[int]],
    hf_model: Any,
    engines: dict[str, LLM],
    args: argparse.Namespace,
) -> None:
    useful = sum(lengths)
    hf_s, hf_tokens = best_of(args.repeats, run_hf, hf_model, prompts, lengths, args.hf_batch_size)
    hf_rate = useful / hf_s
    print(f"\noutput lengths {mix} (mean {useful / len(lengths):.1f}, {useful} tokens)")
    print(f"  {'transformers generate (static)':34s} {hf_rate:8.1f} tok/s  {hf_s:6.2f} s")
    rates = {}
    for label, llm in engines.items():
        seconds, tokens = best_of(args.repeats, run_engine, llm, prompts, lengths)
        rates[label] = useful / seconds
        same = sum(a == b for a, b in zip(tokens, hf_tokens, strict=True))
        print(
            f"  {'hybridkv engine, ' + label:34s} {rates[label]:8.1f} tok/s  {seconds:6.2f} s"
            f"  x{rates[label] / hf_rate:.2f} vs transformers;"
            f" {same}/{len(prompts)} outputs identical to transformers'"
        )
    ratio = rates["cache on"] / rates["cache off"]
    print(f"  prefix caching on / off: x{ratio:.2f}")


if __name__ == "__main__":
    main()

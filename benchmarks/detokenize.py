"""µs of detokenization per output token: the incremental detokenizer (DecodeStream) against
the whole decode it replaced, measured side by side in the same run.

The baseline, :class:`WholeDecode`, is the engine's detokenization up to 7c50ae8 behind the
new class's interface: every token decodes the prompt's last 6 ids and the whole output
again (``decode_output``), so its cost per token grows with the output.

- Per token (always): ``append_and_check`` one token at a time (the engine's per-token
  text and stop work; one-token steps call it so, bursts with several tokens) over
  an output of ``--lengths`` tokens (48 and 1000), with the tests' byte-level tokenizer
  (one id per byte, ``tests/models/tiny.py``) and a Metaspace word tokenizer (one id per
  word, the SentencePiece-style decoder), on valid UTF-8 text. Printed: the mean over the
  whole output and the cost of the last 32 tokens (what a token costs at that length),
  median over ``--repeats`` interleaved rounds.
- Engine (``--engine``): the tests' tiny Qwen3.5, 7 greedy requests generating
  ``--engine-tokens`` tokens each, EOS ignored; ms per decode step over the first and the
  last 48 steps, with the baseline patched into the engine and without, interleaved.

Usage: ``python benchmarks/detokenize.py [--lengths 48 1000] [--repeats 5] [--engine]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from engine_common import ROOT, build_tiny_checkpoint, machine_line

from hybridkv.engine.detokenizer import PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer
from hybridkv.engine.stopping import append_and_check
from hybridkv.models.tokenizer import Tokenizer
from hybridkv.sched.request import Sequence as Seq
from hybridkv.sched.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
TEXT = (
    "The quick brown fox jumps over the lazy dog, and the dog — unbothered — naps on. "
    "Caf\u00e9 au lait co\u00fbte 3\u20ac; \u4e2d\u6587\u4e5f\u53ef\u4ee5. "
)

ROW = "{:<11} {:>6} {:>6} {:>13} {:>12} {:>6}"


class WholeDecode:
    """The detokenization up to 7c50ae8 with :class:`IncrementalDetokenizer`'s interface:
    each push decodes context + the whole output and cuts the context's text off."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool
    ) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix = tokenizer.decode(self.context, skip_special_tokens=self.skip)
        self.ids: list[int] = []
        self.text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        full = self.tokenizer.decode(self.context + self.ids, skip_special_tokens=self.skip)
        prefix = self.prefix
        if prefix and full.startswith(prefix) and not prefix.endswith(REPLACEMENT_CHAR):
            self.text = full[len(prefix) :]
        else:
            self.text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        return ""

    def final_text(self) -> str:
        return self.text


def byte_tokenizer(directory: Path) -> Tokenizer:
    sys.path.insert(0, str(ROOT / "tests" / "models"))
    from tiny import write_tokenizer

    directory.mkdir()
    write_tokenizer(directory)
    return Tokenizer(directory)


def metaspace_tokenizer(directory: Path) -> Tokenizer:
    """Llama-style decoding: words with '▁', the leading space stripped (test_engine_requests)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    words = sorted(set(TEXT.split()))
    vocab = {f"\u2581{w}": i for i, w in enumerate(words)}
    vocab["<unk>"] = len(vocab)
    tok = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    return Tokenizer(directory)


def per_token_us(make: Callable[..., Any], tok: Tokenizer, ids: list[int]) -> tuple[float, float]:
    """(mean µs per token over the output, µs per token of its last 32 tokens)."""
    prompt = ids[:8]
    output = ids[8:]
    seq = Seq("0.0", "r", 0, prompt, SamplingParams(max_tokens=None, ignore_eos=True))
    detokenizer = make(tok, prompt, True)
    tail = max(0, len(output) - 32)
    start = time.perf_counter()
    for i, token in enumerate(output):
        if i == tail:
            tail_start = time.perf_counter()
        append_and_check(
            seq, [token], detokenizer=detokenizer, eos_token_ids=(), max_model_len=1 << 30
        )
    end = time.perf_counter()
    return (end - start) / len(output) * 1e6, (end - tail_start) / (len(output) - tail) * 1e6


def run_per_token(args: argparse.Namespace, tmp: Path) -> None:
    tokenizers = {
        "byte-level": byte_tokenizer(tmp / "bytes"),
        "metaspace": metaspace_tokenizer(tmp / "meta"),
    }
    print("µs of append_and_check per output token, median of", args.repeats, "rounds")
    print(ROW.format("tokenizer", "tokens", "", "whole decode", "incremental", "ratio"))
    for name, tok in tokenizers.items():
        for length in args.lengths:
            ids: list[int] = []
            while len(ids) < length + 8:
                ids += tok.encode(TEXT, add_special_tokens=False)
            ids = ids[: length + 8]
            rounds: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
            for _ in range(args.repeats):
                rounds["old"].append(per_token_us(WholeDecode, tok, ids))
                rounds["new"].append(per_token_us(IncrementalDetokenizer, tok, ids))
            for k, label in ((0, "mean"), (1, "last32")):
                old = statistics.median(r[k] for r in rounds["old"])
                new = statistics.median(r[k] for r in rounds["new"])
                ratio = f"{old / new:.1f}x"
                print(ROW.format(name, length, label, f"{old:.2f}", f"{new:.2f}", ratio))


def run_engine(args: argparse.Namespace, tmp: Path) -> None:
    import hybridkv.engine.llm_engine as llm_engine
    from hybridkv import LLM

    _, path = build_tiny_checkpoint(tmp / "model")
    n = args.engine_tokens
    # one token per step (no decode bursts): the per-step figures stay per token
    llm = LLM(str(path), max_model_len=n + 64, cache_memory_gib=0.25, decode_burst=1)
    prompts = [{"prompt_token_ids": list(range(10 + i, 30 + i))} for i in range(7)]
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    results: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
    for _ in range(args.engine_repeats):
        for label, cls in (("old", WholeDecode), ("new", IncrementalDetokenizer)):
            llm_engine.IncrementalDetokenizer = cls  # type: ignore[misc,assignment]
            engine = llm.engine
            for i, p in enumerate(prompts):
                engine.add_request(f"{label}{len(results[label])}-{i}", p, params)
            times = []
            outputs = []
            while engine.has_unfinished_requests():
                start = time.perf_counter()
                outputs += [o for o in engine.step() if o.finished]
                times.append(time.perf_counter() - start)
            assert all(len(o.outputs[0].token_ids) == n for o in outputs)
            decode = times[1:]  # the first step is the prefill
            results[label].append(
                (statistics.mean(decode[:48]) * 1e3, statistics.mean(decode[-48:]) * 1e3)
            )
    llm_engine.IncrementalDetokenizer = IncrementalDetokenizer  # type: ignore[misc]
    print(f"\nengine, 7 requests x {n} tokens: ms per decode step, median of {args.engine_repeats}")
    for k, label in ((0, "first 48 steps"), (1, "last 48 steps")):
        old = statistics.median(r[k] for r in results["old"])
        new = statistics.median(r[k] for r in results["new"])
        print(f"  {label:<15} whole decode {old:6.2f}  incremental {new:6.2f}  ({old - new:+.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[48, 1000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--engine", action="store_true", help="also time the engine's step")
    parser.add_argument("--engine-tokens", type=int, default=1000)
    parser.add_argument("--engine-repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line())
    with tempfile.TemporaryDirectory() as tmp:
        run_per_token(args, Path(tmp))
        if args.engine:
            run_engine(args, Path(tmp))


if __name__ == "__main__":
    main()

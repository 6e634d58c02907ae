"""Grammar libraries for structured output on CPU: compile time and per-token mask cost.

Candidates: xgrammar, llguidance, outlines-core (each optional: a missing one is skipped).
For each of two byte-level BPE vocabularies trained here with ``tokenizers`` (nothing is
downloaded: the corpus is this Python's own standard library source) -- ~1k tokens (the
size of a test tokenizer) and ~150k (Qwen's size) -- and a JSON schema with nested objects
and arrays, it measures:

- setup: the library's per-tokenizer preparation (done once per server);
- compile: turning the schema into a matcher (done once per request, or cached);
- mask: filling one next-token mask, per generated token, while the matcher walks a valid
  instance token by token (the cost added to every decode step of a constrained request).

Times are medians over repeats (``--repeats``); the per-token figure is the median over all
steps of all repeats. Run: ``python benchmarks/grammar_backends.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "geo": {
                    "type": "object",
                    "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"],
                },
            },
            "required": ["street", "city", "geo"],
        },
        "scores": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"subject": {"type": "string"}, "value": {"type": "number"}},
                "required": ["subject", "value"],
            },
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "scores", "active"],
}
INSTANCE = {
    "name": "Ada Lovelace",
    "age": 36,
    "tags": ["mathematician", "writer", "analyst"],
    "address": {
        "street": "12 St James's Square",
        "city": "London",
        "geo": {"lat": 51.5, "lon": -0.13},
    },
    "scores": [{"subject": "analysis", "value": 9.5}, {"subject": "poetry", "value": 7.25}],
    "active": False,
}
EOS = "<|endoftext|>"


def corpus(max_bytes: int) -> Iterator[str]:
    """Text to train on: this interpreter's standard library sources, up to max_bytes."""
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        total += len(text)
        yield text
        if total >= max_bytes:
            return


def build_tokenizer(vocab_size: int, cache_dir: Path) -> Tokenizer:
    """A byte-level BPE of about ``vocab_size`` tokens (cached in ``cache_dir``)."""
    path = cache_dir / f"bpe_{vocab_size}.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    budget = 2 << 20 if vocab_size < 10_000 else 400 << 20
    tok.train_from_iterator(corpus(budget), trainer)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return tok


def token_bytes(tok: Tokenizer) -> list[bytes]:
    """The raw bytes of every token id (byte-level symbols mapped back to bytes)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # GPT-2's bytes_to_unicode, inverted: printable bytes map to themselves.
    byte_of: dict[str, int] = {}
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    shifted = 0
    for b in range(256):
        if b in printable:
            byte_of[chr(b)] = b
        else:
            byte_of[chr(256 + shifted)] = b
            shifted += 1
    assert set(byte_of) == set(alphabet)
    vocab = tok.get_vocab(with_added_tokens=True)
    out = [b""] * tok.get_vocab_size(with_added_tokens=True)
    for piece, i in vocab.items():
        out[i] = piece.encode() if piece == EOS else bytes(byte_of[c] for c in piece)
    return out


class Backend:
    """One library's three phases, timed by :func:`measure`."""

    name = ""
    vocab = 0

    def load(self) -> None:
        """Import the library (outside the timed phases: imports are a one-off)."""

    def setup(self, tok: Tokenizer, raw: list[bytes], eos: int) -> None: ...

    def compile(self, schema: str) -> Any: ...

    def fill(self, matcher: Any, mask: torch.Tensor) -> None: ...

    def accept(self, matcher: Any, token: int) -> None: ...


class XGrammar(Backend):
    name = "xgrammar"

    def load(self) -> None:
        import xgrammar

        self.xgr = xgrammar

    def setup(self, tok: Tokenizer, raw: list[bytes], eos: int) -> None:
        xgr = self.xgr
        info = xgr.TokenizerInfo(raw, xgr.VocabType.RAW, stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab = len(raw)

    def compile(self, schema: str) -> Any:
        return self.xgr.GrammarMatcher(self.compiler.compile_json_schema(schema))

    def mask(self) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(1, self.vocab)

    def fill(self, matcher: Any, mask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(mask, 0)

    def accept(self, matcher: Any, token: int) -> None:
        assert matcher.accept_token(token), token


class LLGuidance(Backend):
    name = "llguidance"

    def load(self) -> None:
        import llguidance
        import llguidance.torch

        self.ll = llguidance

    def setup(self, tok: Tokenizer, raw: list[bytes], eos: int) -> None:
        self.tok = self.ll.LLTokenizer(tok.to_str(), eos_token=eos)
        self.vocab = len(raw)

    def compile(self, schema: str) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.ll.LLMatcher(self.tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def mask(self) -> torch.Tensor:
        return torch.full(((1, (self.vocab + 31) // 32)), -1, dtype=torch.int32)

    def fill(self, matcher: Any, mask: torch.Tensor) -> None:
        self.ll.torch.fill_next_token_bitmask(matcher, mask, 0)

    def accept(self, matcher: Any, token: int) -> None:
        assert matcher.consume_token(token), (token, matcher.get_error())


class OutlinesCore(Backend):
    name = "outlines-core"

    def load(self) -> None:
        import outlines_core

        self.oc = outlines_core

    def setup(self, tok: Tokenizer, raw: list[bytes], eos: int) -> None:
        outlines_core = self.oc
        table: dict[bytes, list[int]] = {}
        for i, piece in enumerate(raw):
            if i != eos:
                table.setdefault(piece, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, table)
        self.vocab = len(raw)

    def compile(self, schema: str) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(schema)
        return self.oc.Guide(self.oc.Index(regex, self.vocabulary))

    def mask(self) -> torch.Tensor:
        return torch.zeros((1, (self.vocab + 31) // 32), dtype=torch.int32)

    def fill(self, matcher: Any, mask: torch.Tensor) -> None:
        matcher.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())

    def accept(self, matcher: Any, token: int) -> None:
        matcher.advance(token)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def allowed(mask: torch.Tensor, token: int) -> bool:
    return bool((int(mask[0, token // 32]) >> (token % 32)) & 1)


def num_allowed(mask: torch.Tensor, vocab: int) -> int:
    bits = (mask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return int(bits.flatten()[:vocab].sum())


@dataclass
class Samples:
    """One library's timings, gathered over interleaved repeats."""

    setup_s: float = 0.0
    compile_s: list[float] = field(default_factory=list)
    mask_s: list[float] = field(default_factory=list)
    allowed_tokens: list[int] = field(default_factory=list)
    error: str | None = None

    def summary(self) -> dict[str, float]:
        return {
            "setup_ms": self.setup_s * 1e3,
            "compile_ms": statistics.median(self.compile_s) * 1e3,
            "mask_us": statistics.median(self.mask_s) * 1e6,
            "mask_p90_us": statistics.quantiles(self.mask_s, n=10)[-1] * 1e6,
            "mask_mean_us": statistics.fmean(self.mask_s) * 1e6,
            "allowed": statistics.median(self.allowed_tokens),
        }


def walk(backend: Backend, samples: Samples, schema: str, tokens: list[int], eos: int) -> None:
    """One repeat: compile the schema, then mask and accept each token of the instance."""
    vocab = backend.vocab
    seconds, matcher = timed(lambda: backend.compile(schema))
    samples.compile_s.append(seconds)
    mask = backend.mask()
    for token in [*tokens, eos]:
        seconds, _ = timed(lambda m=matcher, b=mask: backend.fill(m, b))
        samples.mask_s.append(seconds)
        samples.allowed_tokens.append(num_allowed(mask, vocab))
        if not allowed(mask, token):
            samples.error = f"rejected token {token} of a valid instance"
            return
        if token != eos:
            backend.accept(matcher, token)


def measure(backends: list[Backend], tok: Tokenizer, repeats: int) -> dict[str, Samples]:
    """Timings of every library, the repeats interleaved (library order rotates), so that a
    burst of load on this shared machine hits them alike."""
    raw = token_bytes(tok)
    eos = tok.token_to_id(EOS)
    schema = json.dumps(SCHEMA)
    tokens = tok.encode(json.dumps(INSTANCE, separators=(",", ":"))).ids
    samples = {b.name: Samples() for b in backends}
    ready = []
    for backend in backends:
        try:
            backend.load()
        except ImportError as exc:
            samples[backend.name].error = f"not installed ({exc.name})"
            continue
        samples[backend.name].setup_s, _ = timed(lambda b=backend: b.setup(tok, raw, eos))
        ready.append(backend)
    for r in range(repeats):
        for backend in ready[r % len(ready) :] + ready[: r % len(ready)]:
            if samples[backend.name].error is None:
                walk(backend, samples[backend.name], schema, tokens, eos)
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vocab", type=int, nargs="*", default=[1_000, 150_000])
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/hybridkv_bench_tokenizers"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(
        f"schema: nested objects and arrays ({len(json.dumps(SCHEMA))} chars); median of "
        f"{args.repeats} repeats; per-token mask over a {len(json.dumps(INSTANCE))}-char instance"
    )
    for size in args.vocab:
        seconds, tok = timed(lambda s=size: build_tokenizer(s, args.cache_dir))
        vocab = tok.get_vocab_size(with_added_tokens=True)
        print(f"\nvocabulary {vocab} tokens (byte-level BPE, built in {seconds:.1f} s)")
        print(
            f"  {'library':14} {'setup ms':>10} {'compile ms':>11} {'mask µs/token':>14} "
            f"{'p90 µs':>9} {'mean µs':>9} {'allowed':>8} {'compile+100 tok ms':>19}"
        )
        results: dict[str, dict[str, float]] = {}
        for name, samples in measure(
            [XGrammar(), LLGuidance(), OutlinesCore()], tok, args.repeats
        ).items():
            if samples.error is not None:
                print(f"  {name:14} {samples.error}")
                continue
            result = results[name] = samples.summary()
            print(
                f"  {name:14} {result['setup_ms']:10.1f} {result['compile_ms']:11.1f} "
                f"{result['mask_us']:14.1f} {result['mask_p90_us']:9.1f} "
                f"{result['mask_mean_us']:9.1f} {result['allowed']:8.0f} "
                f"{result['compile_ms'] + 100 * result['mask_mean_us'] / 1e3:19.1f}"
            )
        if "llguidance" in results:
            base = results["llguidance"]
            ratios = ", ".join(
                f"{name} x{r['mask_us'] / base['mask_us']:.2f} mask, "
                f"x{r['compile_ms'] / base['compile_ms']:.2f} compile"
                for name, r in results.items()
                if name != "llguidance"
            )
            print(f"  vs llguidance: {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

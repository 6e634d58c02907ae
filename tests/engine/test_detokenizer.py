"""Incremental detokenization: the text a sequence's detokenizer grows one id at a time is
the whole decode (the prompt's last ids + the output, less their text) wherever that decode
is prefix-stable, streamed text only grows, and the decode work per token does not grow
with the output.

``whole_text`` (a finished output decoded at once, for requests nobody reads before they
finish) gives the same final text. Three tokenizers: the tests' byte-level one
(``write_tokenizer``), the Metaspace word one (Llama/Mistral-style leading space) and a
byte-fallback one (Gemma / Llama 2-style: its decode rewrites earlier text on invalid
bytes). Unit tests first, then through the engine.
"""

from __future__ import annotations

import itertools
import random
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from engine_checkpoints import ARCH, OPTIONS, tight_cache_gib
from hybrid_checks import prompt
from tiny import write_byte_fallback_tokenizer, write_metaspace_tokenizer, write_tokenizer
from tokenizers import decoders

from hybridkv import LLM, SamplingParams
from hybridkv.engine import LLMEngine
from hybridkv.engine.detokenizer import (
    MAX_HELD_IDS,
    PROMPT_CONTEXT_TOKENS,
    IncrementalDetokenizer,
    whole_text,
)
from hybridkv.engine.stopping import append_and_check, streamable_text
from hybridkv.models.tokenizer import Tokenizer
from hybridkv.sched.request import Sequence as Seq

REPLACEMENT = "\ufffd"
# Text with characters of 1 to 4 UTF-8 bytes, split across ids by byte-level tokenizers.
PIECES = ["a", "b", " ", "\n", "\u00e9", "\u20ac", "\u4e2d", "\U0001f600", "!"]


def full_decode(
    tok: Tokenizer, prompt_ids: Sequence[int], output_ids: Sequence[int], skip: bool = True
) -> str:
    """The oracle: the engine's text up to 7c50ae8 (``decode_output``), one whole decode of
    the prompt's last ids and the output, the context's text cut off (the output decoded
    alone where the context's text is empty, ends in U+FFFD or is not a prefix)."""
    context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
    prefix = tok.decode(context, skip_special_tokens=skip)
    full = tok.decode(context + list(output_ids), skip_special_tokens=skip)
    if prefix and full.startswith(prefix) and not prefix.endswith(REPLACEMENT):
        return full[len(prefix) :]
    return tok.decode(output_ids, skip_special_tokens=skip)


WRITERS = {
    "bytes": write_tokenizer,
    "metaspace": write_metaspace_tokenizer,
    "byte_fallback": write_byte_fallback_tokenizer,
}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    made = {}
    for name, write in WRITERS.items():
        directory = tmp_path_factory.mktemp(f"tokenizer_{name}")
        write(directory)
        made[name] = Tokenizer(directory)
    return made


def valid_text_ids(tok: Tokenizer, kind: str, rng: random.Random, n: int) -> list[int]:
    """Ids of ``n`` random pieces of valid UTF-8 text."""
    if kind == "metaspace":
        return tok.encode(" ".join(f"w{rng.randrange(256)}" for _ in range(n)))
    return tok.encode("".join(rng.choice(PIECES) for _ in range(n)), add_special_tokens=False)


def pushed(detokenizer: IncrementalDetokenizer, ids: Sequence[int]) -> Iterator[str]:
    for token in ids:
        detokenizer.push(token)
        yield detokenizer.text


def assert_grows(texts: Sequence[str]) -> None:
    for before, after in itertools.pairwise(texts):
        assert after.startswith(before), (before, after)


# ------------------------------------------------------------------ the detokenizer alone


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("kind", sorted(WRITERS))
def test_valid_utf8_reads_as_the_whole_decode(
    tokenizers: dict[str, Tokenizer], kind: str, skip: bool
) -> None:
    """Valid UTF-8 text, characters split across ids: at every id the streamable text is
    the whole decode's (not with byte fallback, whose whole decode of an unfinished
    character rewrites the run before it: there only the text at the end is compared),
    and the finished text is the whole decode."""
    tok = tokenizers[kind]
    rng = random.Random(f"{kind}-{skip}")
    for _ in range(60):
        prompt_ids = valid_text_ids(tok, kind, rng, rng.randrange(1, 8))
        output = valid_text_ids(tok, kind, rng, rng.randrange(1, 30))
        detokenizer = IncrementalDetokenizer(tok, prompt_ids, skip)
        texts = list(pushed(detokenizer, output))
        assert_grows([*texts, detokenizer.final_text()])
        assert detokenizer.final_text() == full_decode(tok, prompt_ids, output, skip)
        assert whole_text(tok, prompt_ids, output, skip) == detokenizer.final_text()
        if kind == "byte_fallback":
            continue
        for k, text in enumerate(texts, start=1):
            whole = full_decode(tok, prompt_ids, output[:k], skip)
            assert streamable_text(text, ()) == streamable_text(whole, ())


@pytest.mark.parametrize("skip", [True, False])
def test_any_ids_read_as_the_whole_decode_with_a_byte_level_tokenizer(
    tokenizers: dict[str, Tokenizer], skip: bool
) -> None:
    """A byte-level decoder is prefix-stable on any ids: invalid bytes, specials, ids past
    the vocabulary (259), runs of ids without text longer than MAX_HELD_IDS (at the start:
    inside a character they change the text, see the test after this one)."""
    tok = tokenizers["bytes"]
    continuation = tok.encode("\u20ac", add_special_tokens=False)[1]
    rng = random.Random(7 + skip)
    for case in range(200):
        prompt_ids = [rng.randrange(260) for _ in range(rng.randrange(1, 10))]
        output = [rng.randrange(260) for _ in range(rng.randrange(1, 40))]
        if case % 4 == 0:  # a long run without text: lone continuation bytes or specials
            run = [continuation] if case % 8 else [256, 257, 259]
            output[:0] = [rng.choice(run) for _ in range(3 * MAX_HELD_IDS)]
        detokenizer = IncrementalDetokenizer(tok, prompt_ids, skip)
        texts = list(pushed(detokenizer, output))
        for k, text in enumerate(texts, start=1):
            whole = full_decode(tok, prompt_ids, output[:k], skip)
            assert streamable_text(text, ()) == streamable_text(whole, ()), (prompt_ids, output)
        assert detokenizer.final_text() == full_decode(tok, prompt_ids, output, skip)
        assert whole_text(tok, prompt_ids, output, skip) == detokenizer.final_text()
        assert_grows([*texts, detokenizer.final_text()])


def test_more_than_max_held_ids_without_text_are_given_as_they_decode(
    tokenizers: dict[str, Tokenizer],
) -> None:
    """What bounds the work on ids that never give text: after MAX_HELD_IDS of them their
    text is given as it decodes then. So a character whose bytes are MAX_HELD_IDS skipped
    specials apart reads as U+FFFD per byte, where the whole decode joins the bytes
    (skipped specials vanish): the one place a byte-level text differs from it."""
    tok = tokenizers["bytes"]
    euro = tok.encode("\u20ac", add_special_tokens=False)
    output = [euro[0], *[256] * MAX_HELD_IDS, *euro[1:]]
    detokenizer = IncrementalDetokenizer(tok, tok.encode("Hi "), True)
    texts = list(pushed(detokenizer, output))
    assert_grows([*texts, detokenizer.final_text()])
    assert detokenizer.final_text() == REPLACEMENT * 3  # one per byte
    assert tok.decode(output) == "\u20ac"
    near = [euro[0], *[256] * (MAX_HELD_IDS - 3), *euro[1:]]  # 15 ids held: joined
    assert list(pushed(IncrementalDetokenizer(tok, tok.encode("Hi "), True), near))[-1] == "\u20ac"


def test_a_split_character_is_held_back_then_given_whole(tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers["bytes"]
    euro = tok.encode("\u20ac!", add_special_tokens=False)
    assert len(euro) == 4
    detokenizer = IncrementalDetokenizer(tok, tok.encode("Hi "), True)
    assert [detokenizer.push(t) for t in euro[:2]] == ["", ""]
    assert detokenizer.text == ""
    assert detokenizer.final_text() == REPLACEMENT  # finished here: the whole decode's
    assert [detokenizer.push(t) for t in euro[2:]] == ["\u20ac", "!"]
    assert detokenizer.final_text() == "\u20ac!"


def test_the_prompt_context_keeps_the_leading_space(tokenizers: dict[str, Tokenizer]) -> None:
    """Metaspace strips the first '▁' of a text: the output alone would read 'w3 w4'. A
    prompt ending inside a character is no context: the output is decoded alone."""
    meta = tokenizers["metaspace"]
    detokenizer = IncrementalDetokenizer(meta, meta.encode("w1 w2"), True)
    list(pushed(detokenizer, meta.encode("w3 w4")))
    assert detokenizer.text == " w3 w4"
    assert meta.decode(meta.encode("w3 w4")) == "w3 w4"
    tok = tokenizers["bytes"]
    e_acute = tok.encode("\u00e9", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tok, tok.encode("caf") + e_acute[:1], True)
    list(pushed(detokenizer, e_acute[1:]))
    assert detokenizer.final_text() == REPLACEMENT == tok.decode(e_acute[1:])


def test_a_decoder_that_rewrites_given_text_starts_a_fresh_stream(
    tokenizers: dict[str, Tokenizer],
) -> None:
    """Byte fallback: ' ' (byte 0x20) is given, then 0xE2 and 'c' make the run invalid and
    the whole decode reads '��c', the space rewritten. DecodeStream raises there; the
    space stays given and the held byte and 'c' are decoded afresh: ' �c', then on."""
    tok = tokenizers["byte_fallback"]
    c, hello = tok.backend.token_to_id("c"), tok.backend.token_to_id("\u2581hello")
    output = [0x20, 0xE2, c, hello, 0x68, 0x69]
    detokenizer = IncrementalDetokenizer(tok, [0x68, 0x69], True)
    texts = list(pushed(detokenizer, output))
    rewritten = " \ufffdc"
    assert texts == [
        " ",
        " ",
        rewritten,
        rewritten + " hello",
        rewritten + " helloh",
        rewritten + " hellohi",
    ]
    assert_grows([*texts, detokenizer.final_text()])
    assert tok.decode(output[:3]) == "\ufffd\ufffdc"  # what the whole decode streams instead


def test_decode_work_per_token_is_bounded(tmp_path: Path) -> None:
    """Ids the tokenizer decodes per pushed id (counted inside the Rust decoder, where
    DecodeStream works) stay few whatever the output's length: ~5 a token on valid text
    and random ids, bounded through MAX_HELD_IDS on 1,000 ids without text (lone
    continuation bytes, skipped specials). The whole decode took ~1,000 ids per token at
    the end of a 1,000-id output."""
    write_tokenizer(tmp_path)
    tok, spy = spied_tokenizer(tmp_path)
    rng = random.Random(3)
    continuation = tok.encode("\u20ac", add_special_tokens=False)[1]
    outputs = {
        "text": valid_text_ids(tok, "bytes", rng, 1000)[:1000],
        "random": [rng.randrange(260) for _ in range(1000)],
        "continuation bytes": [continuation] * 1000,
        "specials": [256, 257] * 500,
    }
    for name, output in outputs.items():
        detokenizer = IncrementalDetokenizer(tok, tok.encode("Hello "), True)
        work = []
        for token in output:
            before = spy.ids
            detokenizer.push(token)
            work.append(spy.ids - before)
        assert max(work) <= 4 * MAX_HELD_IDS, (name, max(work))  # 37 on continuation bytes
        assert sum(work) <= 12 * len(work), (name, sum(work))  # 4.6 a token on text
        assert sum(work[-100:]) <= 2 * sum(work[:100]) + 200, name  # flat along the output


class DecodeSpy:
    """A Python decoder around the byte-level one that counts the ids it decodes."""

    def __init__(self) -> None:
        self.ids = 0
        self.inner = decoders.ByteLevel()

    def decode_chain(self, tokens: list[str]) -> list[str]:
        self.ids += len(tokens)
        return [self.inner.decode(tokens)]


def spied_tokenizer(model_dir: Path) -> tuple[Tokenizer, DecodeSpy]:
    tok = Tokenizer(model_dir)
    spy = DecodeSpy()
    tok.backend.decoder = decoders.Decoder.custom(spy)
    return tok, spy


def test_a_stop_string_ending_in_a_split_character_cuts_where_it_begins(
    tokenizers: dict[str, Tokenizer],
) -> None:
    """The stop is found at the id that completes its last character; the text is cut
    before it (kept with include_stop_str_in_output); a running sequence holds back
    len(stop) - 1 characters, so its text only grows."""
    tok = tokenizers["bytes"]
    ids = tok.encode("ab \u20acx\u20ac!", add_special_tokens=False)
    for keep in (False, True):
        params = SamplingParams(stop=["x\u20ac"], include_stop_str_in_output=keep)
        seq = Seq("0.0", "r", 0, tok.encode("Q: "), params)
        detokenizer = IncrementalDetokenizer(tok, seq.prompt_token_ids, True)
        texts = []
        for token in ids:
            _, stop = append_and_check(
                seq, [token], detokenizer=detokenizer, eos_token_ids=(), max_model_len=1000
            )
            texts.append(seq.text)
            if stop is not None:
                break
        assert stop == ("stop", "x\u20ac")
        at_once = Seq("0.1", "r", 0, tok.encode("Q: "), params)  # all the ids in one call
        kept, stop_at_once = append_and_check(
            at_once,
            ids,
            detokenizer=IncrementalDetokenizer(tok, at_once.prompt_token_ids, True),
            eos_token_ids=(),
            max_model_len=1000,
        )
        assert (kept, stop_at_once, at_once.text) == (len(seq.output_token_ids), stop, seq.text)
        assert at_once.output_token_ids == seq.output_token_ids
        assert len(seq.output_token_ids) == len(tok.encode("ab \u20acx\u20ac"))
        assert seq.text == ("ab \u20acx\u20ac" if keep else "ab \u20ac")
        assert_grows(texts)


# ------------------------------------------------------------------ through the engine


def drive(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> Any:
    """Run the requests to the end: ({(request, index): texts streamed}, final outputs)."""
    for request_id, (ids, params) in requests.items():
        engine.add_request(request_id, {"prompt_token_ids": ids}, params)
    streamed: dict[tuple[str, int], list[str]] = {}
    finals = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            return streamed, finals
        for out in engine.step():
            for c in out.outputs:
                streamed.setdefault((out.request_id, c.index), []).append(c.text)
            if out.finished:
                finals[out.request_id] = out
    raise AssertionError("the engine did not finish")


def test_decode_work_per_token_does_not_grow_with_the_output(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: each token decoded the prompt's last 6 ids and the whole output again
    (~110 ids per token at the end of this request, 21 µs at 300 ids). Counted per pushed
    token: a decode burst's tokens all come in one step."""
    engine = llm.engine
    assert engine.tokenizer is not None
    backend = engine.tokenizer.backend
    original = backend.decoder
    spy = DecodeSpy()
    backend.decoder = decoders.Decoder.custom(spy)
    work: list[int] = []  # ids decoded for each output token
    push = IncrementalDetokenizer.push

    def counted(self: IncrementalDetokenizer, token_id: int) -> str:
        before = spy.ids
        piece = push(self, token_id)
        work.append(spy.ids - before)
        return piece

    monkeypatch.setattr(IncrementalDetokenizer, "push", counted)
    try:
        params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
        engine.add_request("long", {"prompt_token_ids": prompt(21, 20)}, params)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        backend.decoder = original
    assert len(work) == 100
    assert max(work) <= 4 * MAX_HELD_IDS, work
    assert sum(work) <= 10 * len(work), work


@pytest.fixture(scope="module")
def metaspace_llm(checkpoints: Any, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    _, path = checkpoints(ARCH)
    model_dir = tmp_path_factory.mktemp("metaspace") / "model"
    shutil.copytree(path, model_dir)
    write_metaspace_tokenizer(model_dir)
    return LLM(str(model_dir), **OPTIONS)


@pytest.mark.parametrize("kind", ["bytes", "metaspace"])
def test_streamed_text_grows_and_ends_as_the_whole_decode(
    llm: LLM, metaspace_llm: LLM, kind: str
) -> None:
    """n = 2 seeded samples of random ids (invalid bytes, specials kept or skipped), a stop
    string: every completion's streamed texts are prefixes of each other and of its final
    text, which is the whole decode of context + output (cut at the stop string)."""
    engine = (llm if kind == "bytes" else metaspace_llm).engine
    tok = engine.tokenizer
    assert tok is not None
    requests = {
        f"{kind}-{skip}": (
            prompt(30 + skip, 12),
            SamplingParams(
                n=2,
                max_tokens=40,
                temperature=1.0,
                seed=4,
                ignore_eos=True,
                skip_special_tokens=skip,
            ),
        )
        for skip in (True, False)
    }
    streamed, finals = drive(engine, requests)
    for request_id, (ids, params) in requests.items():
        for c in finals[request_id].outputs:
            assert c.finish_reason == "length"
            assert c.text == full_decode(tok, ids, c.token_ids, params.skip_special_tokens)
            assert_grows(streamed[request_id, c.index])
        assert finals[request_id].outputs[0].token_ids != finals[request_id].outputs[1].token_ids


def test_streamed_text_only_grows_with_a_byte_fallback_tokenizer(
    checkpoints: Any, tmp_path: Path
) -> None:
    """Regression: with a byte-fallback tokenizer the whole decode of an unfinished or
    invalid run of byte tokens turns the run's valid characters into U+FFFD too, so the
    streamed text shrank (and grew back) as bytes arrived. Now it only grows and the final
    text extends the last streamed one (it may differ from the whole decode in the
    characters the whole decode rewrote)."""
    _, path = checkpoints(ARCH)
    model_dir = tmp_path / "byte_fallback"
    shutil.copytree(path, model_dir)
    write_byte_fallback_tokenizer(model_dir)
    engine = LLM(str(model_dir), **OPTIONS).engine
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=2, ignore_eos=True)
    requests = {f"r{i}": (prompt(50 + i, 10), params) for i in range(6)}
    streamed, finals = drive(engine, requests)
    for request_id in requests:
        [c] = finals[request_id].outputs
        assert_grows(streamed[request_id, 0])
        assert c.text.startswith(streamed[request_id, 0][-1])
        assert len(c.text) >= len(c.token_ids) // 4  # nothing lost: each byte shows


def test_preempted_sequences_keep_their_text(checkpoints: Any) -> None:
    """A cache so small that sequences are preempted and recomputed: the detokenizer is the
    engine's, kept across preemption, so the text goes on where it was: streamed texts
    grow and end as the whole decode, the same as with room."""
    _, path = checkpoints(ARCH)
    options = {**OPTIONS, "max_model_len": 128, "block_size": 8}
    tight = LLM(str(path), **{**options, "cache_memory_gib": tight_cache_gib(path, options)})
    roomy = LLM(str(path), **options)
    params = SamplingParams(n=2, max_tokens=60, temperature=1.0, seed=6, ignore_eos=True)
    requests = {f"p{i}": (prompt(60 + i, 40), params) for i in range(4)}
    streamed, finals = drive(tight.engine, requests)
    assert tight.stats()["num_preemptions"] > 0
    _, expected = drive(roomy.engine, requests)
    tok = tight.get_tokenizer()
    assert tok is not None
    for request_id, (ids, _) in requests.items():
        for c, e in zip(finals[request_id].outputs, expected[request_id].outputs, strict=True):
            assert (c.token_ids, c.text) == (e.token_ids, e.text)
            assert c.text == full_decode(tok, ids, c.token_ids)
            assert_grows(streamed[request_id, c.index])

"""Tokenizer from tokenizer.json + tokenizer_config.json (no transformers at runtime)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny import EOS_ID, write_byte_fallback_tokenizer, write_tokenizer

from hybridkv.models.tokenizer import InvalidStreamPrefix, Tokenizer


@pytest.fixture
def tok(tmp_path: Path) -> Tokenizer:
    write_tokenizer(tmp_path)
    return Tokenizer(tmp_path)


def test_encode_decode_round_trip(tok: Tokenizer) -> None:
    text = "héllo, wörld ✓"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode())  # byte-level, no merges
    assert tok.decode(ids) == text


def test_chat_template_renders_and_tokenizes_specials(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(messages, tokenize=True)
    assert isinstance(ids, list) and ids[0] == 257 and EOS_ID in ids


def test_eos_ids_from_generation_config_then_config(tmp_path: Path) -> None:
    write_tokenizer(tmp_path)
    assert Tokenizer(tmp_path).eos_token_ids == [EOS_ID]
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": 256}}))
    assert Tokenizer(tmp_path).eos_token_ids == [256]
    (tmp_path / "config.json").write_text("{}")
    assert Tokenizer(tmp_path).eos_token_ids == [EOS_ID]  # falls back to the eos token


def test_chat_template_from_jinja_file(tmp_path: Path) -> None:
    write_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages | tojson }}")
    rendered = Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "é"}])
    assert rendered == '[{"role": "user", "content": "é"}]'


LOOP_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
    "{% if loop.index > 3 %}{% break %}{% endif %}"
    "{% generation %}[{{ m['role'] }}]{{ m['content'] }}{% endgeneration %}{% endfor %}"
)


def test_loop_controls_and_generation_tag_render_as_transformers(tmp_path: Path) -> None:
    """Regression: the sandbox refused {% break %} / {% continue %}, which transformers'
    environment (and so every checkpoint template) may use."""
    write_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = LOOP_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [
        {"role": "system", "content": "s"},
        *({"role": "user" if i % 2 else "assistant", "content": str(i)} for i in range(6)),
    ]
    ours = Tokenizer(tmp_path).apply_chat_template(messages, add_generation_prompt=False)
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    theirs = hf.apply_chat_template(
        messages, chat_template=LOOP_TEMPLATE, tokenize=False, add_generation_prompt=False
    )
    assert ours == theirs == "[assistant]0[user]1"


@pytest.mark.parametrize("name", ["tokenize", "namespace", "messages", "tools"])
def test_template_kwargs_may_not_replace_template_names(tok: Tokenizer, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        tok.render_chat([{"role": "user", "content": "hi"}], template_kwargs={name: 1})


def test_lone_surrogate_is_a_value_error(tok: Tokenizer) -> None:
    """Regression: the tokenizers library raised a TypeError (a 500 in the server)."""
    with pytest.raises(ValueError, match="lone surrogate"):
        tok.encode("a\ud800b")


def test_max_token_chars_bounds_the_text_of_any_token(tok: Tokenizer) -> None:
    assert tok.max_token_chars == len("<|endoftext|>")
    text = "<|endoftext|>" * 5
    assert len(tok.encode(text)) * tok.max_token_chars >= len(text)


def test_text_stream_gives_each_ids_text_once_its_characters_are_whole(tok: Tokenizer) -> None:
    """DecodeStream through the wrapper: the text each id adds, None while the ids end
    inside a character ('€' is three byte ids); joined, the whole decode."""
    ids = tok.encode("a\u20ac b")
    stream = tok.text_stream()
    pieces = [stream.step(i) for i in ids]
    assert pieces == ["a", None, None, "\u20ac", " ", "b"]
    assert "".join(p for p in pieces if p) == tok.decode(ids)


def test_text_stream_names_the_error_of_a_rewritten_prefix(tmp_path: Path) -> None:
    """Byte fallback rewrites the space it gave (byte 0x20) once 0xE2 and 'c' make the run
    invalid: tokenizers raises a bare Exception, the wrapper an InvalidStreamPrefix."""
    write_byte_fallback_tokenizer(tmp_path)
    tok = Tokenizer(tmp_path)
    stream = tok.text_stream()
    assert [stream.step(0x20), stream.step(0xE2)] == [" ", None]
    with pytest.raises(InvalidStreamPrefix):
        stream.step(tok.backend.token_to_id("c"))

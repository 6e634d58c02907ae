"""Tokenizer from tokenizer.json + tokenizer_config.json (no transformers at runtime)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny import EOS_ID, write_tokenizer

from hybridkv.models.tokenizer import Tokenizer


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

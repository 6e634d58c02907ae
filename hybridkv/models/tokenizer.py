"""Tokenizer: ``tokenizer.json`` through the ``tokenizers`` library, chat template via jinja2.

transformers is not a runtime dependency, so this reads the files a checkpoint ships:
``tokenizer.json`` (the vocabulary and pipeline), ``tokenizer_config.json`` or
``chat_template.jinja`` (the chat template; transformers 5 writes the latter), and
``generation_config.json`` / ``config.json`` for the end-of-sequence ids.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config writes it: a string or {"content": ...}."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(model_dir: Path, tok_cfg: Mapping[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, **_: Any) -> str:
    """transformers' ``tojson``: no HTML escaping, unlike jinja2's built-in filter."""
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class Tokenizer:
    """encode / decode / apply_chat_template over a checkpoint directory's files."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        self.backend = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        tok_cfg = _read(model_dir / "tokenizer_config.json")
        self.bos_token = _token_text(tok_cfg.get("bos_token"))
        self.eos_token = _token_text(tok_cfg.get("eos_token"))
        self.add_bos_token = bool(tok_cfg.get("add_bos_token", False))
        self.chat_template = _chat_template(model_dir, tok_cfg)
        self.eos_token_ids = self._eos_ids(model_dir)

    def _eos_ids(self, model_dir: Path) -> list[int]:
        """generation_config.json, else config.json (text_config too), else the eos token."""
        config = _read(model_dir / "config.json")
        for source in (
            _read(model_dir / "generation_config.json"),
            config.get("text_config") or {},
            config,
        ):
            eos = source.get("eos_token_id")
            if eos is not None:
                return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
        eos_id = self.backend.token_to_id(self.eos_token) if self.eos_token else None
        return [eos_id] if eos_id is not None else []

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token:
            bos = self.backend.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render the checkpoint's chat template (sandboxed jinja2, as transformers does).

        Raises:
            ValueError: the checkpoint ships no chat template.
        """
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        text = env.from_string(self.chat_template).render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

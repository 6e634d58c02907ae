"""Tokenizer: ``tokenizer.json`` through the ``tokenizers`` library, chat template via jinja2.

transformers is not a runtime dependency, so this reads the files a checkpoint ships:
``tokenizer.json`` (the vocabulary and pipeline), ``tokenizer_config.json`` or
``chat_template.jinja`` (the chat template; transformers 5 writes the latter), and
``generation_config.json`` / ``config.json`` for the end-of-sequence ids.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

# Names the template is rendered with or calls: a caller's template kwargs may not replace
# them (transformers raises a TypeError or renders garbage; here it is a ValueError).
RESERVED_TEMPLATE_NAMES = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "raise_exception",
        "strftime_now",
        # jinja2's own globals, which templates use (namespace() above all)
        "range",
        "dict",
        "lipsum",
        "cycler",
        "joiner",
        "namespace",
    }
)


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


class _GenerationTag(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` (marks assistant spans for
    its masks): rendered as its body, so templates that use it work here too."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's interface)

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def check_text(text: str, what: str = "the text") -> None:
    """Refuse text that cannot be UTF-8 (a lone surrogate such as ``"\\ud800"``, which
    JSON allows): the tokenizer would raise a TypeError deep inside instead.

    Raises:
        ValueError: naming ``what`` and the position of the first bad character.
    """
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{what} contains a lone surrogate (U+{ord(text[exc.start]):04X} at character "
            f"{exc.start}), which is not valid Unicode text"
        ) from None


def _template_env() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in (loop controls included)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env


class InvalidStreamPrefix(ValueError):
    """A decode stream found that its window no longer decodes to the text it already gave.

    Some decoders rewrite earlier text when later ids arrive: a byte-fallback decoder turns
    a whole run of ``<0x..>`` tokens into U+FFFD once the run is no valid UTF-8, including a
    byte it had decoded on its own as a space. ``tokenizers`` then raises a bare
    ``Exception`` ("Invalid prefix encountered..."); this names it, so callers can recover.
    """


class TextStream:
    """The text of a growing list of ids, one id at a time (``tokenizers``' DecodeStream).

    Each :meth:`step` decodes only a window of the last few ids (the previous chunk's ids
    and the new ones) in one call into Rust, so its cost does not grow with the output.
    """

    __slots__ = ("_backend", "_stream")

    def __init__(self, backend: HFTokenizer, skip_special_tokens: bool) -> None:
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str | None:
        """The text ``token_id`` adds; None while it adds none that is final yet (the
        ids end inside a multi-byte character, or the id decodes to nothing).

        Raises:
            InvalidStreamPrefix: the decoder rewrote text this stream already gave.
        """
        try:
            return self._stream.step(self._backend, token_id)
        except Exception as exc:
            if str(exc).startswith("Invalid prefix encountered"):
                raise InvalidStreamPrefix(str(exc)) from None
            raise


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
        self._compiled_template: jinja2.Template | None = None

    def set_chat_template(self, template: str) -> None:
        """Replace the checkpoint's chat template (``--chat-template``)."""
        self.chat_template = template
        self._compiled_template = None

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

    @cached_property
    def max_token_chars(self) -> int:
        """Characters of the longest token (added tokens included): a text longer than
        ``n * max_token_chars`` characters has more than ``n`` tokens, without tokenizing."""
        vocab = self.backend.get_vocab(with_added_tokens=True)
        return max((len(piece) for piece in vocab), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. ``encode_batch`` rather than ``encode``: it lets go of the
        GIL while it works, so a server's event loop keeps running during a long prompt.

        Raises:
            ValueError: the text contains a lone surrogate.
        """
        check_text(text)
        [encoding] = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        ids = encoding.ids
        if add_special_tokens and self.add_bos_token and self.bos_token:
            bos = self.backend.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def text_stream(self, skip_special_tokens: bool = True) -> TextStream:
        """A :class:`TextStream`: incremental :meth:`decode`, for text that grows a token
        at a time (see ``hybridkv.engine.detokenizer``)."""
        return TextStream(self.backend, skip_special_tokens)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The conversation as text, rendered the way transformers' ``apply_chat_template``
        renders it: sandboxed jinja2 with loop controls, ``messages``, ``tools`` (None when
        not given), ``add_generation_prompt``, the special tokens, then the caller's kwargs.

        Raises:
            ValueError: no chat template, or ``template_kwargs`` names a reserved variable.
            jinja2.TemplateError: the template rejected the conversation.
        """
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        extra = dict(template_kwargs or {})
        if clash := RESERVED_TEMPLATE_NAMES & extra.keys():
            raise ValueError(f"chat template kwargs may not set {sorted(clash)}")
        if self._compiled_template is None:
            self._compiled_template = _template_env().from_string(self.chat_template)
        variables: dict[str, Any] = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
        }
        variables.update(extra)  # transformers lets kwargs replace the special tokens
        return self._compiled_template.render(
            messages=list(messages),
            tools=list(tools) if tools is not None else None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """:meth:`render_chat` with transformers' call shape (``kwargs`` go to the template).

        Raises:
            ValueError: the checkpoint ships no chat template.
        """
        text = self.render_chat(
            messages, add_generation_prompt=add_generation_prompt, template_kwargs=kwargs
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


# A worker process's tokenizer (see hybridkv.server.offload): this module imports neither
# torch nor the server, so a spawned worker starts fast and small.
_WORKER_TOKENIZER: Tokenizer | None = None


def load_worker_tokenizer(model_dir: str) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = Tokenizer(model_dir)


def encode_in_worker(text: str, add_special_tokens: bool) -> bytes:
    """Token ids as int32 bytes: the caller's process never builds the Encoding objects."""
    assert _WORKER_TOKENIZER is not None, "load_worker_tokenizer was not called"
    ids = _WORKER_TOKENIZER.encode(text, add_special_tokens=add_special_tokens)
    return array("i", ids).tobytes()

"""Tool-call parsers: a model's text -> OpenAI ``tool_calls``, and back as a grammar.

A parser knows one model family's tool-call syntax both ways: :meth:`ToolParser.extract`
finds the calls in a finished output (what is left is the message content), a
:class:`ToolCallStream` does it incrementally for streaming, and :meth:`ToolParser.grammar`
writes the syntax as a grammar, so ``tool_choice: "required"`` or a named tool constrains
decoding to well-formed calls whose arguments follow the tools' JSON schemas (a random-weight
model still returns valid calls). Parsers are looked up by name (:data:`TOOL_PARSERS`), as
vLLM's ``--tool-call-parser``.

``hermes`` (Hermes 2 Pro, Qwen2.5, Qwen3 and their chat templates)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hybridkv.sched.sampling_params import StructuredOutputsParams

# JSON inside a constrained call: compact separators as models write them, no free
# whitespace (so a weak model cannot pad a call forever).
CALL_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call, OpenAI's shape: ``arguments`` is a JSON string."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True, slots=True)
class ExtractedToolCalls:
    content: str | None  # the text outside the calls (None if only calls)
    calls: list[ToolCall]


class ToolParser:
    """One tool-call syntax. Subclasses set :attr:`name` and implement the three methods."""

    name: ClassVar[str] = ""

    def extract(self, text: str) -> ExtractedToolCalls:
        raise NotImplementedError

    def grammar(self, tools: Sequence[Mapping[str, Any]], parallel: bool) -> str:
        """A Lark grammar whose every sentence is one call (or more, if ``parallel``) of
        one of ``tools`` (OpenAI tool definitions), arguments following its schema."""
        raise NotImplementedError

    def stream(self) -> ToolCallStream:
        raise NotImplementedError

    def constraint(
        self, tools: Sequence[Mapping[str, Any]], parallel: bool
    ) -> StructuredOutputsParams:
        return StructuredOutputsParams(grammar=self.grammar(tools, parallel))


def call_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON schema of one call object: the tool's name, then arguments per its schema."""
    function = tool["function"]
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {
        "x-guidance": CALL_JSON_OPTIONS,
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


@dataclass
class ToolCallStream:
    """Incremental extraction: feed the whole text so far, get what became final.

    Text outside calls is released as soon as it cannot be the start of a call tag; a call
    is released once its closing tag arrives (or at the end, if the output was cut).
    """

    parser: TaggedToolParser
    sent_chars: int = 0  # characters of the text consumed (content sent or calls parsed)
    num_calls: int = 0

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """(new content, new complete calls) given the whole output so far."""
        content: list[str] = []
        calls: list[ToolCall] = []
        open_tag, close_tag = self.parser.open_tag, self.parser.close_tag
        while self.sent_chars < len(text):
            rest = text[self.sent_chars :]
            start = rest.find(open_tag)
            if start < 0:
                keep = 0 if final else _partial_suffix(rest, open_tag)
                content.append(rest[: len(rest) - keep])
                self.sent_chars += len(rest) - keep
                break
            content.append(rest[:start])
            end = rest.find(close_tag, start)
            if end < 0 and not final:
                self.sent_chars += start
                break
            body_end = len(rest) if end < 0 else end
            call = self.parser.parse_call(rest[start + len(open_tag) : body_end])
            if call is not None:
                calls.append(call)
            self.sent_chars += len(rest) if end < 0 else end + len(close_tag)
        self.num_calls += len(calls)
        return "".join(content), calls


def _partial_suffix(text: str, tag: str) -> int:
    """Characters at the end of ``text`` that could be the beginning of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class TaggedToolParser(ToolParser):
    """Calls written as JSON objects between an opening and a closing tag."""

    open_tag: ClassVar[str] = ""
    close_tag: ClassVar[str] = ""

    def __init__(self) -> None:
        self._blocks = re.compile(
            f"{re.escape(self.open_tag)}(.*?)(?:{re.escape(self.close_tag)}|$)", re.DOTALL
        )

    def parse_call(self, body: str) -> ToolCall | None:
        """A call from the JSON between the tags; None if it is not a call object."""
        try:
            data = json.loads(body.strip())
        except json.JSONDecodeError:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return None
        arguments = data.get("arguments", data.get("parameters", {}))
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        return ToolCall(name=data["name"], arguments=arguments)

    def extract(self, text: str) -> ExtractedToolCalls:
        if self.open_tag not in text:
            return ExtractedToolCalls(text, [])
        calls = [c for body in self._blocks.findall(text) if (c := self.parse_call(body))]
        if not calls:  # tags around something that is not a call: leave the text alone
            return ExtractedToolCalls(text, [])
        content = self._blocks.sub("", text).strip()
        return ExtractedToolCalls(content or None, calls)

    def grammar(self, tools: Sequence[Mapping[str, Any]], parallel: bool) -> str:
        bodies = " | ".join(f"%json {json.dumps(call_schema(t))}" for t in tools)
        head = 'start: call ("\\n" call)*' if parallel else "start: call"
        open_text = json.dumps(self.open_tag + "\n")
        close_text = json.dumps("\n" + self.close_tag)
        return f"{head}\ncall: {open_text} body {close_text}\nbody: {bodies}\n"

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


class HermesToolParser(TaggedToolParser):
    name = "hermes"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"


TOOL_PARSERS: dict[str, type[ToolParser]] = {HermesToolParser.name: HermesToolParser}
DEFAULT_TOOL_PARSER = HermesToolParser.name


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered under ``name``.

    Raises:
        ValueError: no such parser (the message lists the known ones).
    """
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()

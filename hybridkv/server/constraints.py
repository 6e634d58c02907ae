"""What a request asks the output to be: structured outputs and tool choice, as one grammar.

Sources, all mapped onto the engine's :class:`StructuredOutputsParams` (at most one per
request, else a 400 naming them): OpenAI's ``response_format`` (``json_object``,
``json_schema``), vLLM's ``structured_outputs`` (json, json_object, regex, choice, grammar)
and its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``,
and, for chat, ``tool_choice: "required"`` or a named tool (the tool parser's grammar).

The grammar is compiled here, off the event loop, so a bad schema is a 400 before anything
is queued and the engine finds the compiled grammar in its cache.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from hybridkv.sched.sampling_params import StructuredOutputsParams
from hybridkv.server.errors import APIError, validation_message
from hybridkv.server.protocol import (
    ChatCompletionRequest,
    NamedFunction,
    NamedToolChoice,
    SamplingFields,
    ToolDefinition,
)
from hybridkv.server.serving import ServingContext
from hybridkv.server.tool_parsers import ToolParser


def _params(param: str, **fields: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as exc:
        raise APIError(str(exc), param=param) from exc


def requested_structure(req: SamplingFields) -> tuple[str, StructuredOutputsParams] | None:
    """(field name, params) of the structured output the request asks for, if any.

    Raises:
        APIError: more than one source, or one that is malformed.
    """
    found: list[tuple[str, StructuredOutputsParams]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", _params("response_format", json_object=True)))
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.json_schema if fmt.json_schema is not None else None
        if schema is None:
            raise APIError(
                "response_format json_schema needs json_schema.schema",
                param="response_format",
            )
        found.append(("response_format", _params("response_format", json=schema)))
    so = req.structured_outputs
    if so is not None:
        fields = {
            "json": so.json_schema,
            "json_object": bool(so.json_object),
            "regex": so.regex,
            "choice": so.choice,
            "grammar": so.grammar,
            "whitespace_flexible": so.whitespace_flexible,
        }
        found.append(("structured_outputs", _params("structured_outputs", **fields)))
    for name, key in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(req, name)
        if value is not None:
            found.append((name, _params(name, **{key: value})))
    if len(found) > 1:
        names = [name for name, _ in found]
        raise APIError(f"give at most one of {names}: each sets the output's grammar")
    return found[0] if found else None


@dataclass(frozen=True, slots=True)
class ToolUse:
    """How a chat request uses its tools."""

    tools: list[dict[str, Any]]  # as the chat template receives them
    parse: bool  # parse the output into tool_calls ("auto", "required", named)
    constraint: StructuredOutputsParams | None  # "required" or named: calls only


def _checked_tools(tools: list[dict[str, Any]]) -> list[ToolDefinition]:
    checked = []
    for i, tool in enumerate(tools):
        try:
            checked.append(ToolDefinition.model_validate(tool))
        except ValidationError as exc:
            message, param = validation_message(exc.errors())
            param = f"tools.{i}.{param}" if param else f"tools.{i}"
            raise APIError(f"tools.{i}: {message}", param=param) from None
    return checked


def _legacy_tools(
    req: ChatCompletionRequest,
) -> tuple[list[dict[str, Any]] | None, Any]:
    """``functions`` / ``function_call`` (the older names) as tools / tool_choice."""
    if req.functions is None or req.tools is not None:
        return req.tools, req.tool_choice
    tools = [
        {"type": "function", "function": f.model_dump(exclude_none=True)} for f in req.functions
    ]
    choice: Any = req.function_call
    if isinstance(choice, NamedFunction):
        choice = NamedToolChoice(type="function", function=choice)
    return tools, choice if choice is not None else req.tool_choice


def tool_use(req: ChatCompletionRequest, parser: ToolParser) -> ToolUse | None:
    """The request's tools and what ``tool_choice`` makes of them (None without tools).

    Raises:
        APIError: a tool_choice without tools, a named tool that is not among them,
            duplicate names, or a constraint combined with a response format.
    """
    tools, choice = _legacy_tools(req)
    if not tools:
        if choice not in (None, "none", "auto"):
            raise APIError("tool_choice needs tools", param="tool_choice")
        return None
    rendered = list(tools)
    names = [t.function.name for t in _checked_tools(tools)]
    if len(set(names)) != len(names):
        raise APIError("tool names must be unique", param="tools")
    if choice == "none":
        return ToolUse(rendered, parse=False, constraint=None)
    if choice is None or choice == "auto":
        return ToolUse(rendered, parse=True, constraint=None)
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise APIError(
                f"tool_choice names {choice.function.name!r}, which is not among the tools {names}",
                param="tool_choice",
            )
        chosen = [rendered[names.index(choice.function.name)]]
        return ToolUse(rendered, parse=True, constraint=parser.constraint(chosen, False))
    constraint = parser.constraint(rendered, req.parallel_tool_calls)
    return ToolUse(rendered, parse=True, constraint=constraint)


async def compile_structure(
    ctx: ServingContext, params: StructuredOutputsParams | None, param: str | None
) -> None:
    """Compile the grammar off the event loop; a bad one is a 400 naming ``param``."""
    if params is None:
        return
    manager = ctx.engine.engine.structured
    if manager is None:
        raise APIError("structured output needs a tokenizer, and this model has none", param=param)
    try:
        await asyncio.to_thread(manager.compile, params)
    except ValueError as exc:
        raise APIError(str(exc), param=param) from exc


def output_structure(
    req: SamplingFields, tools: ToolUse | None
) -> tuple[str | None, StructuredOutputsParams | None]:
    """The one grammar of a request: its structured output, or its tool constraint."""
    structure = requested_structure(req)
    constraint = tools.constraint if tools is not None else None
    if structure is not None and constraint is not None:
        raise APIError(
            f"{structure[0]} cannot be combined with tool_choice 'required' or a named tool",
            param="tool_choice",
        )
    if structure is not None:
        return structure
    return ("tool_choice", constraint) if constraint is not None else (None, None)

"""``POST /v1/chat/completions``: messages rendered with the checkpoint's chat template."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from fastapi.responses import Response
from starlette.requests import Request

from hybridkv.engine.outputs import Logprob, RequestOutput
from hybridkv.models.tokenizer import RESERVED_TEMPLATE_NAMES, Tokenizer
from hybridkv.server.constraints import ToolUse, compile_structure, output_structure, tool_use
from hybridkv.server.errors import APIError
from hybridkv.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    DeltaFunction,
    DeltaMessage,
    DeltaToolCall,
    ResponseFunction,
    ResponseToolCall,
    TokenLogprob,
    TopLogprob,
    Usage,
    dump,
)
from hybridkv.server.serving import (
    ChoiceDelta,
    ServingContext,
    check_length,
    check_response_size,
    new_id,
    now_s,
    refuse_unsupported,
    respond,
    sampling_params,
    usage,
)
from hybridkv.server.tool_parsers import ToolCallStream, ToolParser


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the template sees them: role, text content (None for an assistant
    message that only calls tools), and name, tool_calls, tool_call_id as given.

    Raises:
        APIError: a message without content, other than an assistant's.
    """
    rendered = []
    for i, m in enumerate(messages):
        if m.content is None and m.role != "assistant":
            raise APIError(
                f"messages.{i}.content: a {m.role} message needs content",
                param=f"messages.{i}.content",
            )
        entry: dict[str, Any] = {"role": m.role}
        entry["content"] = None if m.content is None and m.tool_calls else m.text()
        if m.name is not None:
            entry["name"] = m.name
        if m.tool_calls is not None:
            entry["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        rendered.append(entry)
    return rendered


def _render(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    kwargs: dict[str, Any],
    tools: list[dict[str, Any]] | None,
) -> str:
    return tokenizer.render_chat(
        messages,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        template_kwargs=kwargs,
    )


async def chat_prompt_ids(
    ctx: ServingContext, req: ChatCompletionRequest, tools: ToolUse | None = None
) -> list[int]:
    """Token ids of the rendered conversation (rendered and tokenized off the event loop).

    The messages' characters are counted first, and the rendered text's before tokenizing:
    a conversation too long for the context is refused without tokenizing it.
    """
    tokenizer = ctx.tokenizer
    if tokenizer is None or tokenizer.chat_template is None:
        raise APIError("this model has no chat template; use /v1/completions", param="messages")
    kwargs = dict(req.chat_template_kwargs or {})
    if clash := RESERVED_TEMPLATE_NAMES & kwargs.keys():
        raise APIError(
            f"chat_template_kwargs may not set {sorted(clash)}: the template's own names",
            param="chat_template_kwargs",
        )
    messages = template_messages(req.messages)
    ctx.check_prompt_chars(sum(len(m["content"] or "") for m in messages), "messages")
    tool_list = tools.tools if tools is not None else None
    try:
        text = await asyncio.to_thread(
            _render, tokenizer, messages, req.add_generation_prompt, kwargs, tool_list
        )
    except ValueError as exc:
        raise APIError(str(exc), param="messages") from exc
    except Exception as exc:  # the template's own error, or a TypeError inside it
        raise APIError(f"the chat template rejected the messages: {exc}", param="messages") from exc
    ctx.check_prompt_chars(len(text), "messages")
    try:  # the template writes the special tokens itself: do not add them twice
        return await ctx.encode_text(text, add_special_tokens=False)
    except ValueError as exc:
        raise APIError(str(exc), param="messages") from exc


def chat_logprobs(
    logprobs: Sequence[dict[int, Logprob]], token_ids: Sequence[int], top: int
) -> ChatLogprobs:
    content = []
    for entry, token_id in zip(logprobs, token_ids, strict=False):
        sampled = entry[token_id]
        best = sorted(entry.values(), key=lambda lp: lp.rank)[:top]
        content.append(
            TokenLogprob(
                token=sampled.decoded_token or "",
                logprob=sampled.logprob,
                bytes=list((sampled.decoded_token or "").encode()),
                top_logprobs=[
                    TopLogprob(
                        token=lp.decoded_token or "",
                        logprob=lp.logprob,
                        bytes=list((lp.decoded_token or "").encode()),
                    )
                    for lp in best
                ],
            )
        )
    return ChatLogprobs(content=content)


class _Formatter:
    """Builds this endpoint's response, chunk and usage objects for one request.

    With a tool parser, each choice's text is split into content and ``tool_calls``: at
    the end for a whole response, and while streaming as OpenAI streams them (content
    deltas, then one ``tool_calls`` delta per call once its closing tag arrived).
    """

    def __init__(
        self,
        req: ChatCompletionRequest,
        request_id: str,
        model: str,
        parser: ToolParser | None = None,
    ) -> None:
        self.req = req
        self.request_id = request_id
        self.model = model
        self.created = now_s()
        self.top = req.top_logprobs or 0
        self.parser = parser
        self._started: set[int] = set()  # choices whose first chunk (with the role) went out
        self._texts: dict[int, str] = {}  # streamed text so far, per choice (tool parsing)
        self._streams: dict[int, ToolCallStream] = {}

    def _logprobs(self, delta: ChoiceDelta) -> ChatLogprobs | None:
        if not self.req.logprobs:
            return None
        return chat_logprobs(delta.logprobs, delta.token_ids, self.top)

    def _stream_tools(self, d: ChoiceDelta) -> tuple[str, list[DeltaToolCall], bool]:
        """(content to send, call deltas, any call so far) for one streamed delta."""
        if self.parser is None:
            return d.text, [], False
        text = self._texts.get(d.index, "") + d.text
        self._texts[d.index] = text
        stream = self._streams.setdefault(d.index, self.parser.stream())
        first = stream.num_calls
        content, calls = stream.feed(text, final=d.finish_reason is not None)
        deltas = [
            DeltaToolCall(
                index=first + i,
                id=call.id,
                type="function",
                function=DeltaFunction(name=call.name, arguments=call.arguments),
            )
            for i, call in enumerate(calls)
        ]
        return content, deltas, stream.num_calls > 0

    def chunk(
        self, deltas: list[ChoiceDelta], out: RequestOutput | None = None, prompt: int = 0
    ) -> dict[str, Any]:
        choices = []
        for d in deltas:
            first = d.index not in self._started
            self._started.add(d.index)
            content, calls, called = self._stream_tools(d)
            message = DeltaMessage(
                role="assistant" if first else None,
                content=content or ("" if first else None),
                tool_calls=calls or None,
            )
            choices.append(
                ChatChunkChoice(
                    index=d.index,
                    delta=message,
                    logprobs=self._logprobs(d),
                    finish_reason=_finish_reason(d.finish_reason, called),
                    stop_reason=d.stop_reason,
                    token_ids=d.token_ids if self.req.return_token_ids else None,
                )
            )
        chunk = dump(
            ChatCompletionChunk(
                id=self.request_id, created=self.created, model=self.model, choices=choices
            )
        )
        for choice in chunk["choices"]:  # OpenAI's deltas carry only what changed
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        return chunk

    def usage_chunk(self, outs: list[RequestOutput]) -> dict[str, Any]:
        chunk = ChatCompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[],
            usage=Usage.model_validate(usage(outs)),
        )
        return dump(chunk)

    def _message(self, text: str) -> AssistantMessage:
        if self.parser is None:
            return AssistantMessage(content=text)
        found = self.parser.extract(text)
        calls = [
            ResponseToolCall(id=c.id, function=ResponseFunction(name=c.name, arguments=c.arguments))
            for c in found.calls
        ]
        return AssistantMessage(content=found.content, tool_calls=calls or None)

    def response(self, outs: list[RequestOutput]) -> dict[str, Any]:
        [out] = outs
        choices = []
        for c in out.outputs:
            whole = ChoiceDelta.whole(c)
            message = self._message(c.text)
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=self._logprobs(whole),
                    finish_reason=_finish_reason(c.finish_reason, bool(message.tool_calls)),
                    stop_reason=c.stop_reason,
                    token_ids=c.token_ids if self.req.return_token_ids else None,
                )
            )
        response = ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=Usage.model_validate(usage(outs)),
            prompt_token_ids=out.prompt_token_ids if self.req.return_token_ids else None,
        )
        return dump(response)


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's ``tool_calls`` when a choice that stopped by itself called tools."""
    return "tool_calls" if called and reason == "stop" else reason


async def create_chat_completion(
    ctx: ServingContext, req: ChatCompletionRequest, raw: Request
) -> Response:
    """Validate, render the conversation, queue, then stream (SSE) or wait for the reply."""
    ctx.check_model(req.model)
    refuse_unsupported(req)
    if req.modalities is not None and set(req.modalities) - {"text"}:
        raise APIError(
            f"this model outputs text only; modalities {req.modalities} cannot be served",
            param="modalities",
        )
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    # None generates until max_model_len, as OpenAI's chat endpoint does.
    newer = req.max_completion_tokens
    max_tokens = newer if newer is not None else req.max_tokens
    tools = tool_use(req, ctx.tool_parser)
    param, structure = output_structure(req, tools)
    try:
        params = sampling_params(
            req,
            max_tokens,
            logprobs,
            defaults=ctx.sampling_defaults,
            structured_outputs=structure,
        )
    except APIError as exc:
        if exc.param == "logprobs" and req.top_logprobs is not None:
            exc.param = "top_logprobs"
        raise
    await compile_structure(ctx, structure, param)
    prompt_ids = await chat_prompt_ids(ctx, req, tools)
    check_length(ctx, len(prompt_ids), max_tokens, "messages")
    check_response_size(ctx, params, len(prompt_ids), max_tokens)
    parser = ctx.tool_parser if tools is not None and tools.parse else None
    fmt = _Formatter(req, new_id("chatcmpl"), ctx.model_name, parser)
    return await respond(ctx, raw, fmt, [prompt_ids], params, req.stream, req.stream_options)

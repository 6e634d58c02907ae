"""``POST /v1/chat/completions``: messages rendered with the checkpoint's chat template."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import jinja2
from fastapi.responses import Response
from starlette.requests import Request

from hybridkv.engine.llm import render_chat
from hybridkv.engine.outputs import Logprob, RequestOutput
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
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    Usage,
    dump,
)
from hybridkv.server.serving import (
    ChoiceDelta,
    ServingContext,
    check_length,
    new_id,
    now_s,
    refuse_unsupported,
    respond,
    sampling_params,
    usage,
)

# Names the template is rendered with; chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_KWARGS = {"messages", "add_generation_prompt", "bos_token", "eos_token"}


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the template sees them: role and text content (and name, if given).

    Raises:
        APIError: a non-assistant message without content.
    """
    rendered = []
    for i, m in enumerate(messages):
        if m.content is None and m.role != "assistant":
            raise APIError(
                f"messages.{i}.content: a {m.role} message needs content",
                param=f"messages.{i}.content",
            )
        entry = {"role": m.role, "content": m.text()}
        if m.name is not None:
            entry["name"] = m.name
        rendered.append(entry)
    return rendered


async def chat_prompt_ids(ctx: ServingContext, req: ChatCompletionRequest) -> list[int]:
    """Token ids of the rendered conversation (rendered and tokenized off the event loop)."""
    tokenizer = ctx.engine.engine.tokenizer
    if tokenizer is None or tokenizer.chat_template is None:
        raise APIError("this model has no chat template; use /v1/completions", param="messages")
    kwargs = dict(req.chat_template_kwargs or {})
    if clash := RESERVED_TEMPLATE_KWARGS & kwargs.keys():
        raise APIError(
            f"chat_template_kwargs may not set {sorted(clash)}", param="chat_template_kwargs"
        )
    messages = template_messages(req.messages)
    try:
        return await asyncio.to_thread(
            render_chat, tokenizer, messages, req.add_generation_prompt, kwargs
        )
    except (ValueError, jinja2.TemplateError) as exc:
        raise APIError(f"the chat template rejected the messages: {exc}", param="messages") from exc


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
    """Builds this endpoint's response, chunk and usage objects for one request."""

    def __init__(self, req: ChatCompletionRequest, request_id: str, model: str) -> None:
        self.req = req
        self.request_id = request_id
        self.model = model
        self.created = now_s()
        self.top = req.top_logprobs or 0
        self._started: set[int] = set()  # choices whose first chunk (with the role) went out

    def _logprobs(self, delta: ChoiceDelta) -> ChatLogprobs | None:
        if not self.req.logprobs:
            return None
        return chat_logprobs(delta.logprobs, delta.token_ids, self.top)

    def chunk(self, deltas: list[ChoiceDelta]) -> dict[str, Any]:
        choices = []
        for d in deltas:
            first = d.index not in self._started
            self._started.add(d.index)
            message = DeltaMessage(
                role="assistant" if first else None, content=d.text or ("" if first else None)
            )
            choices.append(
                ChatChunkChoice(
                    index=d.index,
                    delta=message,
                    logprobs=self._logprobs(d),
                    finish_reason=d.finish_reason,
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

    def usage_chunk(self, out: RequestOutput) -> dict[str, Any]:
        chunk = ChatCompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[],
            usage=Usage.model_validate(usage(out)),
        )
        return dump(chunk)

    def response(self, out: RequestOutput) -> dict[str, Any]:
        choices = []
        for c in out.outputs:
            whole = ChoiceDelta.whole(c)
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=AssistantMessage(content=c.text),
                    logprobs=self._logprobs(whole),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    token_ids=c.token_ids if self.req.return_token_ids else None,
                )
            )
        response = ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=Usage.model_validate(usage(out)),
            prompt_token_ids=out.prompt_token_ids if self.req.return_token_ids else None,
        )
        return dump(response)


async def create_chat_completion(
    ctx: ServingContext, req: ChatCompletionRequest, raw: Request
) -> Response:
    """Validate, render the conversation, queue, then stream (SSE) or wait for the reply."""
    ctx.check_model(req.model)
    refuse_unsupported(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    # None generates until max_model_len, as OpenAI's chat endpoint does.
    newer = req.max_completion_tokens
    max_tokens = newer if newer is not None else req.max_tokens
    try:
        params = sampling_params(req, max_tokens, logprobs)
    except APIError as exc:
        if exc.param == "logprobs" and req.top_logprobs is not None:
            exc.param = "top_logprobs"
        raise
    prompt_ids = await chat_prompt_ids(ctx, req)
    check_length(ctx, len(prompt_ids), max_tokens, "messages")
    fmt = _Formatter(req, new_id("chatcmpl"), ctx.model_name)
    return await respond(ctx, raw, fmt, prompt_ids, params, req.stream, req.stream_options)

"""``POST /v1/completions``: a prompt (text or token ids) in, text completions out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi.responses import Response
from starlette.requests import Request

from hybridkv.engine.outputs import Logprob, RequestOutput
from hybridkv.sched.sampling_params import SamplingParams
from hybridkv.server.constraints import compile_structure, output_structure
from hybridkv.server.errors import APIError
from hybridkv.server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
    dump,
)
from hybridkv.server.serving import (
    ChoiceDelta,
    ServingContext,
    check_length,
    encode_in_thread,
    new_id,
    now_s,
    refuse_unsupported,
    respond,
    sampling_params,
    usage,
)

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint

PromptInput = str | list[int] | list[str] | list[list[int]]


def single_prompt(prompt: PromptInput) -> str | list[int]:
    """The one prompt of a request: text, token ids, or a one-element list of either.

    Raises:
        APIError: an empty prompt, or several prompts (send one request per prompt).
    """
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) > 1:
            raise APIError(
                f"this server takes one prompt per request, got a list of {len(prompt)}; "
                f"send one request per prompt",
                param="prompt",
            )
        prompt = prompt[0]
    if not prompt:
        raise APIError("the prompt is empty", param="prompt")
    return prompt  # type: ignore[return-value]


def completion_logprobs(
    logprobs: Sequence[dict[int, Logprob]], token_ids: Sequence[int], text_offset: int, top: int
) -> CompletionLogprobs:
    """The legacy format: sampled token, its logprob, the top ``top`` alternatives."""
    result = CompletionLogprobs()
    offset = text_offset
    for entry, token_id in zip(logprobs, token_ids, strict=False):
        sampled = entry[token_id]
        piece = sampled.decoded_token or ""
        result.tokens.append(piece)
        result.token_logprobs.append(sampled.logprob)
        best = sorted(entry.values(), key=lambda lp: lp.rank)[:top]
        result.top_logprobs.append({(lp.decoded_token or ""): lp.logprob for lp in best})
        result.text_offset.append(offset)
        offset += len(piece)
    return result


class _Formatter:
    """Builds this endpoint's response, chunk and usage objects for one request."""

    def __init__(self, req: CompletionRequest, request_id: str, model: str) -> None:
        self.req = req
        self.request_id = request_id
        self.model = model
        self.created = now_s()

    def _choice(self, delta: ChoiceDelta) -> CompletionChoice:
        logprobs = None
        if self.req.logprobs is not None:
            logprobs = completion_logprobs(
                delta.logprobs, delta.token_ids, delta.text_offset, self.req.logprobs
            )
        return CompletionChoice(
            index=delta.index,
            text=delta.text,
            logprobs=logprobs,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
            token_ids=delta.token_ids if self.req.return_token_ids else None,
        )

    def chunk(self, deltas: list[ChoiceDelta]) -> dict[str, Any]:
        chunk = CompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[self._choice(d) for d in deltas],
        )
        return dump(chunk)

    def usage_chunk(self, out: RequestOutput) -> dict[str, Any]:
        chunk = CompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[],
            usage=Usage.model_validate(usage(out)),
        )
        return dump(chunk)

    def response(self, out: RequestOutput) -> dict[str, Any]:
        deltas = [ChoiceDelta.whole(c) for c in out.outputs]
        response = CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[self._choice(d) for d in deltas],
            usage=Usage.model_validate(usage(out)),
            prompt_token_ids=out.prompt_token_ids if self.req.return_token_ids else None,
        )
        return dump(response)


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request) -> Response:
    """Validate, queue, then stream (SSE) or wait for the whole completion."""
    ctx.check_model(req.model)
    refuse_unsupported(req)
    if req.echo:
        raise APIError("echo is not supported by this server", param="echo")
    if req.suffix:
        raise APIError("suffix is not supported by this server", param="suffix")
    prompt = single_prompt(req.prompt)
    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    param, structure = output_structure(req, None)
    params: SamplingParams = sampling_params(
        req, max_tokens, req.logprobs, defaults=ctx.sampling_defaults, structured_outputs=structure
    )
    await compile_structure(ctx, structure, param)
    prompt_ids = await encode_in_thread(ctx, prompt)
    check_length(ctx, len(prompt_ids), max_tokens, "prompt")
    fmt = _Formatter(req, new_id("cmpl"), ctx.model_name)
    return await respond(ctx, raw, fmt, prompt_ids, params, req.stream, req.stream_options)

"""``POST /v1/completions``: prompts (text or token ids) in, text completions out.

A list of prompts runs as one engine request per prompt; choice ``i * n + j`` is prompt
``i``'s ``j``-th completion. ``echo`` puts the prompt in front of each choice's text, and
with ``logprobs`` its tokens in front of the logprobs (the first token has none), which is
how lm-evaluation-harness scores a continuation (``local-completions``); vLLM's
``prompt_logprobs`` returns them per choice in vLLM's shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi.responses import Response
from starlette.requests import Request

from hybridkv.engine.outputs import Logprob, RequestOutput
from hybridkv.server.constraints import compile_structure, output_structure
from hybridkv.server.errors import APIError
from hybridkv.server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprob,
    Usage,
    dump,
)
from hybridkv.server.serving import (
    ChoiceDelta,
    ServingContext,
    check_length,
    check_response_size,
    encode_in_thread,
    new_id,
    now_s,
    refuse_unsupported,
    respond,
    sampling_params,
    usage,
)

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint
MAX_PROMPTS = 128  # prompts per request, as for n: each becomes an engine request

PromptInput = str | list[int] | list[str] | list[list[int]]


def prompt_list(prompt: PromptInput) -> list[str | list[int]]:
    """The prompts of a request: text, token ids, or a list of either.

    Raises:
        APIError: no prompt, an empty one, or more than :data:`MAX_PROMPTS`.
    """
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompts: list[Any] = list(prompt)
    else:
        prompts = [prompt]
    if len(prompts) > MAX_PROMPTS:
        raise APIError(
            f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", param="prompt"
        )
    for i, p in enumerate(prompts):
        if not p:
            where = "the prompt" if len(prompts) == 1 else f"prompt {i}"
            raise APIError(f"{where} is empty", param="prompt")
    return prompts


def completion_logprobs(
    logprobs: Sequence[dict[int, Logprob] | None],
    token_ids: Sequence[int],
    text_offset: int,
    top: int,
    first_piece: str = "",
) -> CompletionLogprobs:
    """The legacy format: each token, its logprob, the top ``top`` alternatives (an entry
    of None, the first echoed prompt token, has neither: its text is ``first_piece``)."""
    result = CompletionLogprobs()
    offset = text_offset
    for entry, token_id in zip(logprobs, token_ids, strict=False):
        if entry is None:
            piece = first_piece
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            sampled = entry[token_id]
            piece = sampled.decoded_token or ""
            result.token_logprobs.append(sampled.logprob)
            best = sorted(entry.values(), key=lambda lp: lp.rank)[:top]
            result.top_logprobs.append({(lp.decoded_token or ""): lp.logprob for lp in best})
        result.tokens.append(piece)
        result.text_offset.append(offset)
        offset += len(piece)
    return result


@dataclass(frozen=True, slots=True)
class Echo:
    """What ``echo`` puts in front of a choice: the prompt's text, tokens and logprobs."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]
    first_piece: str  # the first prompt token's text (it has no logprob entry)


class _Formatter:
    """Builds this endpoint's response, chunk and usage objects for one request."""

    def __init__(
        self,
        req: CompletionRequest,
        request_id: str,
        model: str,
        n: int,
        prompt_texts: list[str],
        first_pieces: list[str],
    ) -> None:
        self.req = req
        self.request_id = request_id
        self.model = model
        self.created = now_s()
        self.n = n
        self.prompt_texts = prompt_texts  # what echo shows of each prompt
        self.first_pieces = first_pieces
        self.echoes: dict[int, Echo] = {}  # per prompt, once its first output arrived
        self._echoed: set[int] = set()  # choices whose echo went out (streaming)

    def _echo(self, prompt_index: int, out: RequestOutput | None) -> Echo | None:
        if not self.req.echo:
            return None
        if prompt_index not in self.echoes and out is not None:
            first = out.prompt_logprobs[0] if out.prompt_logprobs else None
            ids = out.prompt_token_ids
            logprobs = list(out.prompt_logprobs or [first] * len(ids))
            if out.prompt_logprobs is not None:  # the first token's piece, for its text
                logprobs[0] = None
            self.echoes[prompt_index] = Echo(
                self.prompt_texts[prompt_index], ids, logprobs, self.first_pieces[prompt_index]
            )
        return self.echoes.get(prompt_index)

    def _choice(
        self, delta: ChoiceDelta, echo: Echo | None, out: RequestOutput | None
    ) -> CompletionChoice:
        text, token_ids, entries, offset = delta.text, delta.token_ids, delta.logprobs, 0
        echo_entries: list[dict[int, Logprob] | None] = []
        if echo is not None:
            text = echo.text + text
            echo_entries = echo.logprobs
            offset = delta.text_offset
        logprobs = None
        if self.req.logprobs is not None:
            if echo is not None:
                logprobs = completion_logprobs(
                    [*echo_entries, *entries],
                    [*echo.token_ids, *token_ids],
                    0,
                    self.req.logprobs,
                    echo.first_piece,
                )
                prompt_chars = len(echo.text)
                # completion tokens start after the echoed prompt's text
                count = len(echo.token_ids)
                logprobs.text_offset[count:] = [
                    prompt_chars + t for t in _offsets(entries, token_ids, delta.text_offset)
                ]
            else:
                logprobs = completion_logprobs(
                    entries, token_ids, delta.text_offset + offset, self.req.logprobs
                )
        prompt_logprobs = None
        if self.req.prompt_logprobs is not None and out is not None and out.prompt_logprobs:
            prompt_logprobs = vllm_prompt_logprobs(out.prompt_logprobs)
        return CompletionChoice(
            index=delta.index,
            text=text,
            logprobs=logprobs,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
            token_ids=delta.token_ids if self.req.return_token_ids else None,
            prompt_logprobs=prompt_logprobs,
        )

    def chunk(self, deltas: list[ChoiceDelta], out: RequestOutput, prompt: int) -> dict[str, Any]:
        choices = []
        for d in deltas:
            first = d.index not in self._echoed
            self._echoed.add(d.index)
            echo = self._echo(prompt, out) if first else None
            choices.append(self._choice(d, echo, out if first else None))
        chunk = CompletionChunk(
            id=self.request_id, created=self.created, model=self.model, choices=choices
        )
        return dump(chunk)

    def usage_chunk(self, outs: list[RequestOutput]) -> dict[str, Any]:
        chunk = CompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[],
            usage=Usage.model_validate(usage(outs)),
        )
        return dump(chunk)

    def response(self, outs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for p, out in enumerate(outs):
            echo = self._echo(p, out)
            for c in out.outputs:
                whole = ChoiceDelta.whole(c)
                delta = ChoiceDelta(
                    p * self.n + c.index,
                    whole.text,
                    whole.token_ids,
                    whole.logprobs,
                    0,
                    0,
                    whole.finish_reason,
                    whole.stop_reason,
                )
                choices.append(self._choice(delta, echo, out))
        prompt_ids = outs[0].prompt_token_ids if len(outs) == 1 else None
        response = CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=Usage.model_validate(usage(outs)),
            prompt_token_ids=prompt_ids if self.req.return_token_ids else None,
        )
        return dump(response)


def _offsets(
    entries: Sequence[dict[int, Logprob]], token_ids: Sequence[int], start: int
) -> list[int]:
    offsets, at = [], start
    for entry, token in zip(entries, token_ids, strict=False):
        offsets.append(at)
        at += len(entry[token].decoded_token or "")
    return offsets


def vllm_prompt_logprobs(
    entries: Sequence[dict[int, Logprob] | None],
) -> list[dict[str, PromptLogprob] | None]:
    return [
        None
        if entry is None
        else {
            str(t): PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
            for t, lp in entry.items()
        }
        for entry in entries
    ]


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request) -> Response:
    """Validate, queue one engine request per prompt, then stream (SSE) or wait for all."""
    ctx.check_model(req.model)
    refuse_unsupported(req)
    if req.suffix:
        raise APIError("suffix is not supported by this server", param="suffix")
    prompts = prompt_list(req.prompt)
    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    param, structure = output_structure(req, None)
    prompt_logprobs = req.prompt_logprobs
    if req.echo and req.logprobs is not None:  # echo + logprobs: the prompt's too
        prompt_logprobs = max(prompt_logprobs or 0, req.logprobs)
    params = sampling_params(
        req,
        max_tokens,
        req.logprobs,
        defaults=ctx.sampling_defaults,
        structured_outputs=structure,
        prompt_logprobs=prompt_logprobs,
    )
    await compile_structure(ctx, structure, param)
    prompt_ids = [await encode_in_thread(ctx, p) for p in prompts]
    for ids in prompt_ids:
        check_length(ctx, len(ids), max_tokens, "prompt")
        check_response_size(ctx, params, len(ids), max_tokens)
    texts, firsts = [], []
    tokenizer = ctx.tokenizer
    if req.echo and tokenizer is not None:
        for p, ids in zip(prompts, prompt_ids, strict=True):
            texts.append(p if isinstance(p, str) else tokenizer.decode(ids, False))
            firsts.append(tokenizer.decode(ids[:1], skip_special_tokens=False))
    elif req.echo:
        raise APIError("echo needs a tokenizer, and this model has none", param="echo")
    fmt = _Formatter(req, new_id("cmpl"), ctx.model_name, params.n, texts, firsts)
    return await respond(ctx, raw, fmt, prompt_ids, params, req.stream, req.stream_options)

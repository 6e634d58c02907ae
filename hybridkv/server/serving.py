"""What both endpoints share: request -> SamplingParams, limits, the output stream, deltas.

The endpoint modules (:mod:`completions`, :mod:`chat`) only turn a prompt into token ids
and outputs into their response shapes; validation that needs the engine (vocabulary,
``max_model_len``) and the run itself live here so both endpoints refuse the same inputs
with the same messages.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from hybridkv.engine.outputs import CompletionOutput, Logprob, RequestOutput
from hybridkv.sched.sampling_params import GREEDY_BELOW, RequestOutputKind, SamplingParams
from hybridkv.server.async_engine import AsyncEngine, EngineDeadError, RequestStream
from hybridkv.server.errors import APIError, error_body
from hybridkv.server.metrics import ServerMetrics
from hybridkv.server.offload import TokenizerOffload
from hybridkv.server.tool_parsers import HermesToolParser, ToolParser

if TYPE_CHECKING:
    from hybridkv.models.tokenizer import Tokenizer
    from hybridkv.server.protocol import SamplingFields, StreamOptions

T = TypeVar("T")
_SAMPLING_FIELDS = {f for f in SamplingParams.__dataclass_fields__ if not f.startswith("_")}


@dataclass
class ServingContext:
    """What a handler needs: the engine front, the served name, the metrics to record."""

    engine: AsyncEngine
    model_name: str
    metrics: ServerMetrics
    tool_parser: ToolParser = field(default_factory=HermesToolParser)
    offload: TokenizerOffload | None = None  # long texts tokenize in a worker process

    async def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text, off the event loop (a worker process for long texts).

        Raises:
            ValueError: no tokenizer, or the text contains a lone surrogate.
        """
        if self.offload is not None:
            return await self.offload.encode(text, add_special_tokens)
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer.json: pass prompt token ids")
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    @property
    def sampling_defaults(self) -> Mapping[str, Any]:
        """Sampling fields the model's generation config sets (vLLM applies them too)."""
        return self.engine.engine.generation_defaults

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.engine.tokenizer

    @property
    def max_prompt_chars(self) -> int:
        """Characters a prompt may have: more cannot fit in max_model_len tokens whatever
        they are (no token is longer than the longest in the vocabulary), so longer text
        is refused before the tokenizer spends seconds on it."""
        tokenizer = self.tokenizer
        longest = tokenizer.max_token_chars if tokenizer is not None else 1
        return self.max_model_len * max(1, longest)

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """A 400 for text too long to fit in the context, counted before tokenizing."""
        if num_chars > self.max_prompt_chars:
            raise APIError(
                f"this model's maximum context length is {self.max_model_len} tokens, and "
                f"the prompt has {num_chars} characters: more than {self.max_prompt_chars} "
                f"characters can never fit in it",
                param=param,
                code="context_length_exceeded",
            )

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                status=404,
                param="model",
                code="model_not_found",
            )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def refuse_unsupported(req: SamplingFields) -> None:
    """OpenAI fields this engine cannot honour: a 400 unless they are at their no-op value."""
    if req.best_of is not None and req.best_of != req.n:
        raise APIError("best_of is not supported by this server (use n)", param="best_of")


def logit_bias(req: SamplingFields) -> dict[int, float] | None:
    """OpenAI's logit_bias (token id strings as keys) with integer keys."""
    if not req.logit_bias:
        return None
    bias = {}
    for key, value in req.logit_bias.items():
        if not key.isdigit() or not key.isascii():
            raise APIError(
                f"logit_bias keys must be token ids (decimal integers), got {key!r}",
                param="logit_bias",
            )
        bias[int(key)] = value
    return bias


# request field -> its value when neither the request nor the generation config sets it
_VLLM_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


def sampling_params(
    req: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    *,
    defaults: Mapping[str, Any] | None = None,
    **extra: Any,
) -> SamplingParams:
    """The engine's SamplingParams; its ValueError (it names the field) becomes a 400.

    A field the request leaves unset takes ``defaults`` (the engine's
    ``generation_defaults``, from the model's generation_config.json), else vLLM's
    default, as vLLM's ``to_sampling_params`` does; so does ``max_tokens`` when None.
    ``extra``: more SamplingParams fields the endpoint decided (structured outputs...).
    """
    defaults = defaults or {}

    def pick(name: str) -> Any:
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, _VLLM_DEFAULTS[name])

    temperature = pick("temperature")
    if 0 < temperature < GREEDY_BELOW:
        temperature = 0.0
    if max_tokens is None:
        max_tokens = defaults.get("max_tokens")
    try:
        return SamplingParams(
            n=req.n,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=pick("top_p"),
            top_k=pick("top_k"),
            min_p=pick("min_p"),
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            presence_penalty=pick("presence_penalty"),
            frequency_penalty=pick("frequency_penalty"),
            repetition_penalty=pick("repetition_penalty"),
            logit_bias=logit_bias(req),
            min_tokens=req.min_tokens,
            bad_words=req.bad_words,
            **extra,
        )
    except ValueError as exc:
        first = str(exc).split(" ", 1)[0]
        raise APIError(str(exc), param=first if first in _SAMPLING_FIELDS else None) from exc


def check_length(
    ctx: ServingContext, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str
) -> None:
    """A 400 when prompt + max_tokens cannot fit in max_model_len (OpenAI's wording)."""
    limit = ctx.max_model_len
    if num_prompt_tokens >= limit:
        raise APIError(
            f"this model's maximum context length is {limit} tokens, but the prompt has "
            f"{num_prompt_tokens} tokens: no room left to generate",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
        raise APIError(
            f"this model's maximum context length is {limit} tokens, but "
            f"{num_prompt_tokens + max_tokens} were requested ({num_prompt_tokens} in the "
            f"prompt, {max_tokens} to generate); lower max_tokens or the prompt",
            param="max_tokens",
            code="context_length_exceeded",
        )


MAX_LOGPROB_ENTRIES = 1 << 18  # log-probability entries one response may carry (~13 MB)


def check_response_size(
    ctx: ServingContext, params: SamplingParams, num_prompt_tokens: int, max_tokens: int | None
) -> None:
    """A 400 for a request whose log-probabilities alone would make an absurd response:
    n x (top logprobs + 1) x max_tokens, plus the prompt's when asked for."""
    entries = 0
    if params.logprobs is not None:
        tokens = max_tokens if max_tokens is not None else ctx.max_model_len - num_prompt_tokens
        entries += params.n * (params.logprobs + 1) * tokens
    if params.prompt_logprobs is not None:
        entries += params.n * (params.prompt_logprobs + 1) * num_prompt_tokens
    if entries > MAX_LOGPROB_ENTRIES:
        raise APIError(
            f"this request asks for {entries} log-probability entries (n x (top logprobs + 1) "
            f"x tokens); at most {MAX_LOGPROB_ENTRIES} per request: lower n, the top "
            f"logprobs or max_tokens",
            param="logprobs",
        )


async def encode_in_thread(ctx: ServingContext, prompt: Any) -> list[int]:
    """Token ids of a prompt, tokenized off the event loop (a 4 MiB prompt takes a while);
    text that cannot fit in the context is refused before the tokenizer sees it."""
    try:
        if isinstance(prompt, str):
            ctx.check_prompt_chars(len(prompt), "prompt")
            if not prompt:
                raise ValueError("the prompt is empty")
            prompt = await ctx.encode_text(prompt)
        _, ids = await asyncio.to_thread(ctx.engine.engine.inputs.encode, prompt)
    except ValueError as exc:
        raise APIError(str(exc), param="prompt") from exc
    return ids


def open_stream(
    ctx: ServingContext, request_id: str, prompt_ids: list[int], params: SamplingParams
) -> RequestStream:
    """Queue the request now; the engine's refusal (a ValueError) becomes a 400."""
    try:
        return ctx.engine.add_request(request_id, {"prompt_token_ids": prompt_ids}, params)
    except ValueError as exc:
        raise APIError(str(exc)) from exc
    except EngineDeadError as exc:
        raise APIError(str(exc), status=503) from exc


async def observed(ctx: ServingContext, stream: RequestStream) -> AsyncIterator[RequestOutput]:
    """The stream's outputs, recording time to first token once and the other latencies at
    the finish; closes the stream at exit."""
    seen_token = False
    try:
        async for out in stream:
            if not seen_token and out.metrics and out.metrics.time_to_first_token is not None:
                seen_token = True
                ctx.metrics.observe_ttft(out.metrics.time_to_first_token)
            if out.finished:
                ctx.metrics.observe_finished(out)
            yield out
    finally:
        stream.close()


async def last_output(ctx: ServingContext, stream: RequestStream) -> RequestOutput:
    """The final output (non-streaming requests); a cancelled wait aborts the request."""
    out: RequestOutput | None = None
    try:
        async for latest in observed(ctx, stream):
            out = latest
    except EngineDeadError as exc:
        raise APIError(str(exc), status=500) from exc
    finally:
        stream.close()
    assert out is not None
    return out


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Run ``work`` but cancel it when the client goes away (None then).

    Non-streaming handlers are not cancelled by Starlette on disconnect; without this, a
    client that gave up would keep its request generating (and holding pages) to the end.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the handler itself is cancelled (shutdown)
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# ---------------------------------------------------------------------------- deltas


@dataclass(frozen=True, slots=True)
class ChoiceDelta:
    """What one completion added since the last chunk."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    first_token_offset: int  # tokens of this completion sent before this delta
    text_offset: int  # characters of the token pieces of this completion sent before it
    finish_reason: str | None
    stop_reason: int | str | None

    @classmethod
    def whole(cls, c: CompletionOutput) -> ChoiceDelta:
        """A whole completion as one delta (a non-streaming response's choice)."""
        logprobs = c.logprobs or []
        return cls(c.index, c.text, c.token_ids, logprobs, 0, 0, c.finish_reason, c.stop_reason)


@dataclass
class DeltaTracker:
    """Turns cumulative outputs into per-choice increments for streaming.

    While a stop string could still match, its possible start is held back (the last
    ``len(longest stop) - 1`` characters), so text a client received is never cut later.
    """

    holdback_chars: int
    index_offset: int = 0  # added to each completion's index (prompt i of a list: i * n)
    sent_chars: dict[int, int] = field(default_factory=dict)
    sent_tokens: dict[int, int] = field(default_factory=dict)
    # Logprob text offsets count token pieces, not the (held-back) text sent: a token's
    # offset must not depend on how much text a stop-string hold-back kept back so far.
    sent_piece_chars: dict[int, int] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)

    @classmethod
    def for_params(cls, params: SamplingParams, index_offset: int = 0) -> DeltaTracker:
        longest = max((len(s) for s in params.stop_strings), default=0)
        return cls(holdback_chars=max(0, longest - 1), index_offset=index_offset)

    def advance(self, out: RequestOutput) -> list[ChoiceDelta]:
        deltas = []
        for comp in out.outputs:
            if comp.index in self.done:
                continue
            chars = self.sent_chars.get(comp.index, 0)
            tokens = self.sent_tokens.get(comp.index, 0)
            visible = len(comp.text) if comp.finished else len(comp.text) - self.holdback_chars
            text = comp.text[chars:visible] if visible > chars else ""
            new_ids = comp.token_ids[tokens:]
            if not text and not new_ids and not comp.finished:
                continue
            logprobs = list(comp.logprobs[tokens:]) if comp.logprobs is not None else []
            pieces = self.sent_piece_chars.get(comp.index, 0)
            deltas.append(
                ChoiceDelta(
                    self.index_offset + comp.index,
                    text,
                    new_ids,
                    logprobs,
                    tokens,
                    pieces,
                    comp.finish_reason,
                    comp.stop_reason,
                )
            )
            self.sent_chars[comp.index] = chars + len(text)
            self.sent_tokens[comp.index] = len(comp.token_ids)
            self.sent_piece_chars[comp.index] = pieces + sum(
                len(entry[t].decoded_token or "") if t in entry else 0
                for entry, t in zip(logprobs, new_ids, strict=False)
            )
            if comp.finished:
                self.done.add(comp.index)
        return deltas


def usage(outs: list[RequestOutput]) -> dict[str, Any]:
    """OpenAI's usage object over a request's prompts (each prompt counted once, as vLLM
    does for n > 1); cached_tokens is the prompts' prefix-cache hit."""
    prompt = sum(len(out.prompt_token_ids) for out in outs)
    completion = sum(len(c.token_ids) for out in outs for c in out.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(out.num_cached_tokens for out in outs)},
    }


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


def engine_failure(out: RequestOutput) -> APIError | None:
    """The engine gave up on the request (it cannot fit, or a step failed)."""
    if out.error is None:
        return None
    return APIError(out.error, status=500 if "failed" in out.error else 400)


# (new pieces of the choices, the prompt's latest output, the prompt's index) -> a chunk
ChunkMaker = Callable[[list[ChoiceDelta], RequestOutput, int], dict[str, Any] | None]
# A chunk carrying more log-probability entries than this is built in a worker thread.
OFFLOAD_CHUNK_ENTRIES = 512


async def merged(
    ctx: ServingContext, handles: list[RequestStream]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) of several requests as they come; one request: in order."""
    if len(handles) == 1:
        async for out in observed(ctx, handles[0]):
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, handle: RequestStream) -> None:
        try:
            async for out in observed(ctx, handle):
                queue.put_nowait((i, out))
        except BaseException as exc:  # delivered to the consumer, which re-raises it
            queue.put_nowait((i, exc))
        else:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for handle in handles:
            handle.close()


def _entries(deltas: list[ChoiceDelta]) -> int:
    return sum(len(entry) for d in deltas for entry in d.logprobs)


async def sse_events(
    ctx: ServingContext,
    handles: list[RequestStream],
    params: SamplingParams,
    make_chunk: ChunkMaker,
    usage_chunk: Callable[[list[RequestOutput]], dict[str, Any]] | None,
) -> AsyncIterator[str]:
    """Server-sent events of a request's prompts: chunks, an optional usage chunk, ``[DONE]``.

    A failure after the stream started cannot change the 200 status any more, so it is
    sent as an OpenAI error object in a ``data:`` line (what vLLM does), then ``[DONE]``.
    Large chunks (many log-probabilities) are built and serialized in a worker thread.
    """
    trackers = [DeltaTracker.for_params(params, i * params.n) for i in range(len(handles))]
    finals: list[RequestOutput | None] = [None] * len(handles)
    failure: APIError | None = None
    try:
        async for i, out in merged(ctx, handles):
            failure = engine_failure(out)
            if failure is not None:
                break
            finals[i] = out
            deltas = trackers[i].advance(out)
            if not deltas:
                continue
            if _entries(deltas) > OFFLOAD_CHUNK_ENTRIES:
                event = await asyncio.to_thread(_sse_chunk, make_chunk, deltas, out, i)
            else:
                event = _sse_chunk(make_chunk, deltas, out, i)
            if event:
                yield event
    except EngineDeadError as exc:
        failure = APIError(str(exc), status=500)
    finally:
        for handle in handles:
            handle.close()
    if failure is not None:
        yield sse(error_body(failure.message, failure.status, failure.param, failure.code))
    elif usage_chunk is not None and all(out is not None for out in finals):
        yield sse(usage_chunk([out for out in finals if out is not None]))
    yield "data: [DONE]\n\n"


def _sse_chunk(
    make_chunk: ChunkMaker, deltas: list[ChoiceDelta], out: RequestOutput, prompt: int
) -> str:
    chunk = make_chunk(deltas, out, prompt)
    return sse(chunk) if chunk is not None else ""


class Formatter(Protocol):
    """An endpoint's response shapes (chat and completions each have one)."""

    request_id: str

    def chunk(
        self, deltas: list[ChoiceDelta], out: RequestOutput, prompt: int
    ) -> dict[str, Any] | None: ...

    def usage_chunk(self, outs: list[RequestOutput]) -> dict[str, Any]: ...

    def response(self, outs: list[RequestOutput]) -> dict[str, Any]: ...


def open_streams(
    ctx: ServingContext, request_id: str, prompts: list[list[int]], params: SamplingParams
) -> list[RequestStream]:
    """Queue one engine request per prompt (all or none: a refusal closes the others)."""
    handles: list[RequestStream] = []
    try:
        for i, prompt_ids in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            handles.append(open_stream(ctx, rid, prompt_ids, params))
    except BaseException:
        for handle in handles:
            handle.close()
        raise
    return handles


async def last_outputs(ctx: ServingContext, handles: list[RequestStream]) -> list[RequestOutput]:
    try:
        return list(await asyncio.gather(*(last_output(ctx, h) for h in handles)))
    finally:
        for handle in handles:
            handle.close()


def json_bytes(build: Callable[[], dict[str, Any]]) -> bytes:
    return json.dumps(build(), ensure_ascii=False, separators=(",", ":")).encode()


async def respond(
    ctx: ServingContext,
    raw: Request,
    fmt: Formatter,
    prompts: list[list[int]],
    params: SamplingParams,
    stream: bool | None,
    stream_options: StreamOptions | None,
) -> Response:
    """Run a validated request (one engine request per prompt): server-sent events if
    ``stream``, else one JSON response, built and serialized in a worker thread (a response
    with thousands of log-probabilities takes a while).

    A non-streaming client that leaves gets its requests cancelled (status 499, read by
    nobody), and an engine failure becomes an OpenAI error.
    """
    if not stream:  # only the final output is read: the engine need build no other
        params = replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
    handles = open_streams(ctx, fmt.request_id, prompts, params)
    if stream:
        include_usage = bool(stream_options and stream_options.include_usage)
        usage_chunk = fmt.usage_chunk if include_usage else None
        return SSEResponse(sse_events(ctx, handles, params, fmt.chunk, usage_chunk))
    outs = await unless_disconnected(raw, last_outputs(ctx, handles))
    if outs is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    for out in outs:
        failure = engine_failure(out)
        if failure is not None:
            raise failure
    body = await asyncio.to_thread(json_bytes, lambda: fmt.response(outs))
    return Response(body, media_type="application/json")


class SSEResponse(StreamingResponse):
    """A streaming response that always closes its body iterator.

    Starlette cancels the response when the client disconnects; if that happens while a
    chunk is being sent, the generator sits at its ``yield`` and its ``finally`` (the
    abort that frees the request's pages) would wait for garbage collection. Closing it
    here makes the abort immediate.
    """

    media_type = "text/event-stream"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()

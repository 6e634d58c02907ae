"""``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``: vLLM's tokenizer routes.

(lm-evaluation-harness's ``tokenizer_backend=remote`` tokenizes through them.)

``/tokenize`` takes either a ``prompt`` (with ``add_special_tokens``, default true) or chat
``messages`` rendered with the checkpoint's template (what ``/v1/chat/completions`` would
feed the model), and answers ``{"count", "max_model_len", "tokens", "token_strs"}``;
``/detokenize`` takes ``tokens`` and answers ``{"prompt"}``. Both run off the event loop
and refuse what the completion endpoints refuse (text too long for the context, ids
outside the vocabulary, lone surrogates).
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import ValidationError

from hybridkv.server.chat import chat_prompt_ids
from hybridkv.server.constraints import tool_use
from hybridkv.server.errors import APIError, validation_message
from hybridkv.server.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    dump,
)
from hybridkv.server.serving import ServingContext


async def tokenize(ctx: ServingContext, req: TokenizeRequest) -> dict[str, Any]:
    if req.model is not None:
        ctx.check_model(req.model)
    tokenizer = ctx.tokenizer
    if tokenizer is None:
        raise APIError("this model has no tokenizer", param="prompt")
    if (req.prompt is None) == (req.messages is None):
        raise APIError("give exactly one of 'prompt' and 'messages'", param="prompt")
    if req.prompt is not None:
        ctx.check_prompt_chars(len(req.prompt), "prompt")
        try:
            ids = await ctx.encode_text(req.prompt, req.add_special_tokens)
        except ValueError as exc:
            raise APIError(str(exc), param="prompt") from exc
    else:
        try:
            chat = ChatCompletionRequest.model_validate(
                {
                    "model": ctx.model_name,
                    "messages": req.messages,
                    "add_generation_prompt": req.add_generation_prompt,
                    "chat_template_kwargs": req.chat_template_kwargs,
                    "tools": req.tools,
                }
            )
        except ValidationError as exc:
            message, param = validation_message(exc.errors())
            raise APIError(message, param=param) from None
        ids = await chat_prompt_ids(ctx, chat, tool_use(chat, ctx.tool_parser))
    strs = None
    if req.return_token_strs:
        strs = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    response = TokenizeResponse(
        count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs
    )
    return dump(response)


async def detokenize(ctx: ServingContext, req: DetokenizeRequest) -> dict[str, Any]:
    if req.model is not None:
        ctx.check_model(req.model)
    tokenizer = ctx.tokenizer
    if tokenizer is None:
        raise APIError("this model has no tokenizer", param="tokens")
    vocab = ctx.engine.engine.vocab_size
    for i, token in enumerate(req.tokens):
        if not 0 <= token < vocab:
            raise APIError(
                f"tokens.{i}: token id {token} is outside the vocabulary [0, {vocab})",
                param="tokens",
            )
    text = await asyncio.to_thread(tokenizer.decode, req.tokens, False)
    return dump(DetokenizeResponse(prompt=text))


def tokenizer_info(ctx: ServingContext) -> dict[str, Any]:
    """vLLM's ``/tokenizer_info``: the special tokens and the chat template."""
    tokenizer = ctx.tokenizer
    if tokenizer is None:
        raise APIError("this model has no tokenizer", status=404)
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": None,
        "chat_template": tokenizer.chat_template,
        "model_max_length": ctx.max_model_len,
        "vocab_size": ctx.engine.engine.vocab_size,
    }

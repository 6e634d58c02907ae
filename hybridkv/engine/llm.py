"""LLM: the offline API, shaped like vLLM's so user code moves over unchanged.

llm = LLM(model="path/to/checkpoint", max_model_len=4096, cache_memory_gib=2.0)
outs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=32))
llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0))
llm.stats()
llm.reset_prefix_cache()  # nothing cached hits afterwards

Threads: one ``LLM`` may be called from several threads at once. Each call queues its
requests, then the calling threads take turns running engine steps under one lock; a step
runs every queued request, whoever queued it (so concurrent calls batch together), and
each call returns as soon as its own requests have finished.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping, Sequence
from dataclasses import fields, replace
from typing import Any

from rich.progress import Progress

from hybridkv.engine.config import (
    OFFLINE_DECODE_BURST,
    OFFLINE_MAX_NUM_BATCHED_TOKENS,
    EngineConfig,
)
from hybridkv.engine.inputs import PromptType
from hybridkv.engine.llm_engine import LLMEngine
from hybridkv.engine.outputs import RequestOutput
from hybridkv.models.tokenizer import Tokenizer
from hybridkv.sched.sampling_params import RequestOutputKind, SamplingParams

Message = Mapping[str, Any]


def _is_single_prompt(prompts: object) -> bool:
    """A str, a dict, or a flat list of ints is one prompt; a list of those is a batch."""
    if isinstance(prompts, str | Mapping):
        return True
    return isinstance(prompts, Sequence) and bool(prompts) and isinstance(prompts[0], int)


class LLM:
    """Offline generation with continuous batching and hybrid prefix caching.

    Keyword options are :class:`EngineConfig`'s fields, under vLLM's names where vLLM has
    one (max_model_len, max_num_seqs, max_num_batched_tokens (here 4096 unless given, as
    vLLM's CPU default for its LLM class; decode_burst 16 and no decode_burst_budget_ms
    unless given: nobody streams), gpu_memory_utilization,
    cache_memory_gib, block_size, enable_prefix_caching, dtype, kv_cache_dtype,
    generation_config, chat_template, tokenizer, trust_remote_code, seed, ...). Start-up
    logs the capacity report (logger ``hybridkv.engine``); :meth:`stats` holds it too.
    Safe to call from several threads (see the module docstring).

    Raises:
        TypeError: an option that is not an EngineConfig field.
        ValueError: a bad option value, or a checkpoint that cannot be served.
    """

    def __init__(self, model: str, **options: Any) -> None:
        known = {f.name for f in fields(EngineConfig)}
        if unknown := sorted(options.keys() - known):
            raise TypeError(
                f"LLM() got unknown option(s) {unknown}; the options are EngineConfig's: "
                f"{sorted(known - {'model'})}"
            )
        if options.get("max_num_batched_tokens") is None:  # None: this API's default, as vLLM
            options["max_num_batched_tokens"] = OFFLINE_MAX_NUM_BATCHED_TOKENS
        # nobody streams: bursts as long as a block, whatever they take (decode_burst)
        options.setdefault("decode_burst", OFFLINE_DECODE_BURST)
        options.setdefault("decode_burst_budget_ms", None)
        self.engine = LLMEngine(EngineConfig(model=str(model), **options))
        self._ids = itertools.count()
        self._step_lock = threading.Lock()  # one thread steps the engine at a time
        self._finished: dict[str, RequestOutput] = {}  # finished, not yet taken by its caller

    @property
    def capacity_report(self) -> list[str]:
        """The start-up capacity report, one line per fact."""
        return list(self.engine.capacity_report)

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` uses without ``sampling_params``: the generation config's defaults."""
        return self.engine.default_sampling_params()

    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run the prompts to completion; outputs in the order of ``prompts``.

        Raises:
            ValueError: a bad prompt or parameter (nothing is queued then).
        """
        batch: list[PromptType] = [prompts] if _is_single_prompt(prompts) else list(prompts)  # type: ignore[list-item,arg-type]
        if isinstance(sampling_params, Sequence):
            params = list(sampling_params)
            if len(params) != len(batch):
                raise ValueError(
                    f"{len(params)} sampling params for {len(batch)} prompts: give one or one each"
                )
        else:
            params = [sampling_params or self.get_default_sampling_params()] * len(batch)
        params = _final_only(params)
        checked = [  # check all before queueing any; each prompt is tokenized once
            self.engine.validate_request(prompt, p) for prompt, p in zip(batch, params, strict=True)
        ]
        with self._step_lock:
            ids = [f"{next(self._ids)}" for _ in batch]
        for request_id, (text, prompt_ids), p in zip(ids, checked, params, strict=True):
            self.engine.queue_validated(request_id, text, prompt_ids, p)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (the model's chat template).

        ``tools`` (OpenAI's ``{"type": "function", "function": {...}}`` entries) reach the
        template as transformers passes them.

        Raises:
            ValueError: no tokenizer or chat template, or a malformed message.
        """
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot chat")
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        prompts: list[PromptType] = []
        for conversation in conversations:
            prompts.append(
                {
                    "prompt_token_ids": render_chat(
                        tokenizer,
                        conversation,
                        add_generation_prompt,
                        chat_template_kwargs,
                        tools=tools,
                    )
                }
            )  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until every request of ``ids`` finished; other callers' outputs are kept."""
        done: dict[str, RequestOutput] = {}
        with Progress(disable=not use_tqdm, transient=True) as progress:
            task = progress.add_task("generating", total=len(ids))
            while len(done) < len(ids):
                with self._step_lock:
                    for request_id in ids:
                        if request_id not in done and request_id in self._finished:
                            done[request_id] = self._finished.pop(request_id)
                            progress.advance(task)
                    if len(done) == len(ids):
                        break
                    for out in self.engine.step():
                        if out.finished:
                            self._finished[out.request_id] = out
        return [done[i] for i in ids]

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (:meth:`LLMEngine.reset_prefix_cache`), between two steps:
        requests other threads are running go on unaffected."""
        with self._step_lock:
            return self.engine.reset_prefix_cache()

    def stats(self) -> dict[str, Any]:
        """:meth:`LLMEngine.stats` between two steps (the capacity report included)."""
        with self._step_lock:
            return self.engine.stats()


def _final_only(params: list[SamplingParams]) -> list[SamplingParams]:
    """``params`` asking for the final output only (vLLM's LLM does the same): ``generate``
    returns nothing else, so the engine need not build an output every step nor, without
    stop strings, decode the text a token at a time. Copies: the caller's are unchanged."""
    copies: dict[int, SamplingParams] = {}
    for p in params:
        if id(p) not in copies:
            copies[id(p)] = replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
    return [copies[id(p)] for p in params]


def render_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Message],
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """Token ids of a conversation rendered with the checkpoint's chat template.

    Raises:
        ValueError: a message is not {"role": str, "content": str} (an assistant message
            with ``tool_calls`` may leave content out), no chat template, or a kwarg that
            names one of the template's own variables.
        jinja2.TemplateError: the template rejected the conversation.
    """
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ValueError(f"message {i} must be a dict with a string 'role'")
        content = m.get("content")
        if not isinstance(content, str) and not (content is None and m.get("tool_calls")):
            raise ValueError(f"message {i} must have string 'content'")
    text = tokenizer.render_chat(
        messages,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        template_kwargs=chat_template_kwargs,
    )
    # The template writes the special tokens itself (BOS included): do not add them twice.
    return tokenizer.encode(text, add_special_tokens=False)

"""LLMEngine: requests in, one scheduled and sampled step at a time, RequestOutputs out.

The loop a server drives (``LLM`` drives it to completion)::

    engine.add_request("a", "Hello", SamplingParams(max_tokens=8))   # any thread
    while engine.has_unfinished_requests():
        for out in engine.step():          # progress of every request that moved
            ...

``add_request`` and ``abort_request`` validate in the caller's thread (a bad request
raises ``ValueError`` there, before the engine sees it) and hand the request over through
a locked inbox that ``step`` drains, so a server may call them while a step runs in
another thread. Everything else belongs to the thread calling ``step``.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridkv.core.manager import CacheConfig, CacheManager
from hybridkv.core.spec import ModelSpec
from hybridkv.engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig
from hybridkv.engine.logits_processors import RowContext
from hybridkv.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from hybridkv.engine.request import Sequence
from hybridkv.engine.runner import ModelRunner
from hybridkv.engine.sampler import SampledToken, SamplingFailure, sample
from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.engine.scheduler import ScheduledChunk, Scheduler
from hybridkv.engine.stopping import decode_output, update_and_check
from hybridkv.engine.structured_output import GrammarMatcher, StructuredOutputManager
from hybridkv.models.loader import load_model
from hybridkv.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

PromptType = str | Seq[int] | Mapping[str, Any]
STATE_PAGES_PER_SEQ = 3  # live page + a snapshot being written + a restored hit held


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    error: str | None = None
    generators: list[torch.Generator | None] = field(default_factory=list)
    bad_words: list[list[int]] = field(default_factory=list)  # token ids of each
    matchers: list[GrammarMatcher | None] = field(default_factory=list)  # per sequence

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


def resolve_dtype(dtype: str, device: str, config_path: str) -> str:
    """ "auto": float32 on CPU (bf16 matmuls are slow there), else the checkpoint's dtype."""
    if dtype != "auto":
        return dtype
    if device == "cpu":
        return "float32"
    import json
    from pathlib import Path

    raw = json.loads((Path(config_path) / "config.json").read_text())
    text = raw.get("text_config") or raw
    named = (
        text.get("torch_dtype") or text.get("dtype") or raw.get("torch_dtype") or raw.get("dtype")
    )
    return named if named in ("float32", "bfloat16", "float16") else "bfloat16"


def max_fitting_len(manager: CacheManager, spec: ModelSpec, block_size: int) -> int:
    """Tokens of the longest single sequence the arena holds (full chunks only)."""
    layout = manager.layout
    state_chunks = sum(
        -(-STATE_PAGES_PER_SEQ // layout.pages_per_chunk(g.group_id))
        for g in spec.groups
        if g.is_recurrent
    )
    free = layout.num_full_chunks - state_chunks
    token_groups = [g.group_id for g in spec.groups if not g.is_recurrent]
    if free < 0:
        return 0
    if not token_groups:
        return 1 << 62  # a pure recurrent model: length costs no memory

    def chunks_for(num_blocks: int) -> int:
        return sum(-(-num_blocks // layout.pages_per_chunk(g)) for g in token_groups)

    lo, hi = 0, 1
    while chunks_for(hi) <= free:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # the largest block count whose chunks fit
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if chunks_for(mid) <= free else (lo, mid)
    return lo * block_size


class LLMEngine:
    """The serving engine of one model: scheduler, cache manager, runner and sampler."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        dtype = resolve_dtype(config.dtype, config.device, config.model)
        self.device = torch.device(config.device)
        loaded = load_model(config.model, dtype=dtype)
        self.model_config = loaded.config
        self.spec = loaded.spec
        self.tokenizer: Tokenizer | None = loaded.tokenizer
        self.dtype = dtype
        self.vocab_size = int(loaded.config.get("vocab_size") or 0)
        self.manager = CacheManager(
            loaded.spec,
            CacheConfig(
                memory_bytes=config.cache_memory_bytes,
                block_tokens=config.block_size,
                enable_prefix_caching=config.enable_prefix_caching,
                checkpoint=config.checkpoint_policy,
                eviction=config.eviction_policy,
                eviction_alpha=config.eviction_alpha,
            ),
        )
        self.max_model_len = self._choose_max_model_len(config)
        self.eos_token_ids = set(self.tokenizer.eos_token_ids if self.tokenizer else [])
        if not self.eos_token_ids and self.model_config.get("eos_token_id") is not None:
            eos = self.model_config["eos_token_id"]
            self.eos_token_ids = set(eos if isinstance(eos, list) else [eos])
        self.structured: StructuredOutputManager | None = None
        if self.tokenizer is not None:
            self.structured = StructuredOutputManager(
                self.tokenizer, self.vocab_size, sorted(self.eos_token_ids)
            )
        model = loaded.model.to(self.device)
        self.runner = ModelRunner(
            model, loaded.spec, self.manager.layout, self.device, poison_arena=config.poison_cache
        )
        budget = config.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        self.scheduler = Scheduler(
            self.manager, max_num_seqs=config.max_num_seqs, max_num_batched_tokens=budget
        )
        self._rng = random.Random(config.seed)
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()
        self._inbox: list[_Request] = []
        self._abort_inbox: list[str] = []
        self._pending_ids: set[str] = set()
        self._order = 0
        self.num_finished = 0
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.num_steps = 0

    @classmethod
    def from_model(cls, model: str, **options: Any) -> LLMEngine:
        return cls(EngineConfig(model=str(model), **options))

    def _choose_max_model_len(self, config: EngineConfig) -> int:
        fits = max_fitting_len(self.manager, self.spec, config.block_size)
        if config.max_model_len is not None:
            if config.max_model_len > fits:
                raise ValueError(
                    f"max_model_len={config.max_model_len} does not fit in the cache: "
                    f"{config.cache_memory_gib} GiB holds one sequence of at most {fits} "
                    f"tokens; raise cache_memory_gib or lower max_model_len"
                )
            return config.max_model_len
        if fits <= 0:
            raise ValueError(
                f"cache_memory_gib={config.cache_memory_gib} cannot hold one sequence of "
                f"this model; raise it"
            )
        native = self.spec.max_model_len or self.model_config.get("max_position_embeddings")
        if native and native <= fits:
            return int(native)
        if native:
            logger.warning(
                "max_model_len lowered from the model's %d to %d tokens: what %.2f GiB of "
                "cache holds for one sequence",
                native,
                fits,
                config.cache_memory_gib,
            )
        return min(fits, int(native)) if native else min(fits, 4096)

    # ------------------------------------------------------------------ requests

    def encode_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as text, token ids, or a vLLM-style dict.

        Raises:
            ValueError: the prompt is empty, malformed, or text without a tokenizer.
        """
        text: str | None = None
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
            elif isinstance(prompt.get("prompt"), str):
                return self.encode_prompt(prompt["prompt"])
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: pass prompt_token_ids")
            text = prompt
            ids = self.tokenizer.encode(prompt) if prompt else []
        else:
            ids = prompt
        if not isinstance(ids, Seq) or isinstance(ids, str):
            raise ValueError(
                f"prompt token ids must be a list of integers, got {type(ids).__name__}"
            )
        ids = list(ids)
        if not ids:
            raise ValueError("the prompt is empty")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"prompt token id {t!r} is outside the vocabulary [0, {self.vocab_size})"
                )
        return text, ids

    def validate_request(
        self, prompt: PromptType, params: SamplingParams
    ) -> tuple[str | None, list[int]]:
        """Every check ``add_request`` makes except the id: (text, token ids) of the prompt.

        Batch APIs call it on all requests before queueing any, so a bad one queues nothing.

        Raises:
            ValueError: a bad prompt, one that leaves no room to generate within
                max_model_len, or stop strings without a tokenizer.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        text, ids = self.encode_prompt(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}: "
                f"no room left to generate"
            )
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids")
        for token in params.logit_bias or {}:
            if token >= self.vocab_size:
                raise ValueError(
                    f"logit_bias token id {token} is outside the vocabulary [0, {self.vocab_size})"
                )
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer")
        if params.structured_outputs is not None:
            if self.structured is None:
                raise ValueError("structured outputs need a tokenizer")
            self.structured.compile(params.structured_outputs)  # a bad grammar raises here
        return text, ids

    def grammar_matchers(self, params: SamplingParams) -> list[GrammarMatcher | None]:
        """One grammar walk per completion (compiled once per grammar, then cached)."""
        if params.structured_outputs is None or self.structured is None:
            return [None] * params.n
        compiled = self.structured.compile(params.structured_outputs)
        return [compiled.matcher() for _ in range(params.n)]

    def bad_words_ids(self, params: SamplingParams) -> list[list[int]]:
        """Token ids of each bad word, alone and after a space (vLLM's rule: the spaced form
        counts only if it is a different first token of the same length)."""
        if not params.bad_words or self.tokenizer is None:
            return []
        result: list[list[int]] = []
        for word in params.bad_words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            result.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                result.append(spaced)
        return [ids for ids in result if ids]

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request; it runs from the next ``step``.

        Raises:
            ValueError: a duplicate id, a bad prompt, a prompt that leaves no room to
                generate within max_model_len, or stop strings without a tokenizer.
        """
        params = params if params is not None else SamplingParams()
        text, ids = self.validate_request(prompt, params)
        bad_words = self.bad_words_ids(params)
        matchers = self.grammar_matchers(params)
        now = time.monotonic() if arrival_time is None else arrival_time
        with self._lock:
            if request_id in self._pending_ids:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._pending_ids.add(request_id)
            order = self._order
            self._order += 1
            # Sequence ids are the engine's own ("<arrival order>.<index>"), never derived
            # from request ids, which users choose and which could collide with them.
            seqs = [
                Sequence(
                    seq_id=f"{order}.{i}",
                    request_id=request_id,
                    index=i,
                    prompt_token_ids=ids,
                    params=params,
                )
                for i in range(params.n)
            ]
            self._inbox.append(
                _Request(
                    request_id,
                    text,
                    ids,
                    params,
                    seqs,
                    RequestMetrics(arrival_time=now),
                    bad_words=bad_words,
                    matchers=matchers,
                )
            )

    def abort_request(self, request_id: str) -> None:
        """Cancel a request (a disconnected client); its pages go back at the next step."""
        with self._lock:
            self._abort_inbox.append(request_id)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._pending_ids)

    def _drain_inbox(self) -> list[RequestOutput]:
        with self._lock:
            new, self._inbox = self._inbox, []
            aborts, self._abort_inbox = self._abort_inbox, []
        for req in new:
            req.generators = [self._generator(req.params, s.index) for s in req.seqs]
            self._requests[req.request_id] = req
            self.num_prompt_tokens += len(req.prompt_token_ids)
            for seq in req.seqs:
                self.scheduler.add(seq)
        outputs = []
        for request_id in aborts:
            req = self._requests.get(request_id)
            if req is None or req.finished:
                continue
            for seq in req.seqs:
                if not seq.finished:
                    self.scheduler.finish(seq, "abort")
            outputs.append(self._finish_request(req))
        return outputs

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.greedy:
            return None
        seed = params.child_seed(index)
        if seed is None:
            seed = self._rng.getrandbits(63)
        return torch.Generator().manual_seed(seed % (1 << 64))  # torch takes 64-bit seeds

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample one step; the outputs of every request that moved."""
        outputs = self._drain_inbox()
        sched = self.scheduler.schedule()
        touched: dict[str, _Request] = {}
        for seq in sched.rejected:
            req = self._requests[seq.request_id]
            req.error = (
                f"the request does not fit in the cache ({self.config.cache_memory_gib} GiB) "
                f"even alone"
            )
            touched[req.request_id] = req
        if sched.chunks:
            self.num_steps += 1
            try:
                logits = self.runner.execute(sched.chunks, self.manager)
                sampled = self._sample(sched.chunks, logits)
            except Exception as exc:  # never leave sequences holding pages after a crash
                logger.exception("model step failed")
                for chunk in sched.chunks:
                    req = self._requests[chunk.seq.request_id]
                    req.error = f"model step failed: {exc}"
                    self.scheduler.finish(chunk.seq, "abort")
                    touched[req.request_id] = req
            else:
                self._postprocess(sched.chunks, sampled, touched)
        for req in touched.values():
            if req.finished:
                outputs.append(self._finish_request(req))
            else:
                outputs.append(self._output(req))
        return outputs

    def _sample(
        self, chunks: list[ScheduledChunk], logits: torch.Tensor
    ) -> dict[int, SampledToken | SamplingFailure]:
        """The next token of every chunk that reached the end of its known tokens."""
        rows = [i for i, c in enumerate(chunks) if c.samples]
        if not rows:
            return {}
        contexts = [self._row_context(chunks[i].seq) for i in rows]
        return dict(zip(rows, sample(logits[rows], contexts), strict=True))

    def _row_context(self, seq: Sequence) -> RowContext:
        req = self._requests[seq.request_id]
        params = seq.params
        stop_ids: set[int] = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        return RowContext(
            params=params,
            generator=req.generators[seq.index],
            prompt_ids=seq.prompt_token_ids,
            output_ids=seq.output_token_ids,
            stop_ids=stop_ids,
            bad_words=req.bad_words,
            matcher=req.matchers[seq.index] if req.matchers else None,
        )

    def _postprocess(
        self,
        chunks: list[ScheduledChunk],
        sampled: dict[int, SampledToken | SamplingFailure],
        touched: dict[str, _Request],
    ) -> None:
        now = time.monotonic()
        for i, chunk in enumerate(chunks):
            seq = chunk.seq
            req = self._requests[seq.request_id]
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            token = sampled.get(i)
            if isinstance(token, SamplingFailure):  # this sequence alone fails
                req.error = f"sampling failed for this request: {token.message}"
                self.scheduler.finish(seq, "abort")
                touched[req.request_id] = req
                continue
            self.scheduler.advance(chunk, token.token_id if token else None)
            if token is None:
                continue
            self.num_generated_tokens += 1
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            self._record_logprobs(seq, token)
            stop = update_and_check(
                seq,
                token.token_id,
                tokenizer=self.tokenizer,
                eos_token_ids=self.eos_token_ids,
                max_model_len=self.max_model_len,
            )
            matcher = req.matchers[seq.index] if req.matchers else None
            if stop is None and matcher is not None:
                try:
                    matcher.accept(token.token_id)
                except ValueError as exc:
                    req.error = f"sampling failed for this request: {exc}"
                    stop = ("abort", None)
                else:
                    if matcher.is_finished:  # the grammar is complete: nothing may follow
                        seq.text = decode_output(seq, self.tokenizer)
                        stop = ("stop", None)
            if stop is not None:
                self.scheduler.finish(seq, *stop)
            touched[req.request_id] = req

    def _record_logprobs(self, seq: Sequence, token: SampledToken) -> None:
        if token.logprob is None:
            return
        seq.cumulative_logprob += token.logprob
        entry: dict[int, object] = {
            tid: Logprob(lp, rank, self._piece(tid)) for tid, lp, rank in token.top
        }
        entry.setdefault(
            token.token_id, Logprob(token.logprob, token.rank, self._piece(token.token_id))
        )
        seq.logprobs.append(entry)

    def _piece(self, token_id: int) -> str | None:
        return (
            self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else None
        )

    # ------------------------------------------------------------------ outputs

    def _output(self, req: _Request) -> RequestOutput:
        completions = [
            CompletionOutput(
                index=s.index,
                text=s.text,
                token_ids=list(s.output_token_ids),
                cumulative_logprob=s.cumulative_logprob if s.params.logprobs is not None else None,
                logprobs=list(s.logprobs) if s.params.logprobs is not None else None,  # type: ignore[arg-type]
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for s in req.seqs
        ]
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=completions,
            finished=req.finished,
            num_cached_tokens=req.seqs[0].num_cached_tokens,
            metrics=req.metrics,
            error=req.error,
        )

    def _finish_request(self, req: _Request) -> RequestOutput:
        req.metrics.finished_time = time.monotonic()
        self._requests.pop(req.request_id, None)
        with self._lock:
            self._pending_ids.discard(req.request_id)
        self.num_finished += 1
        return self._output(req)

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        """Counters and cache occupancy (what /metrics and ``LLM.stats()`` report).

        Reads state that ``step`` changes: call it from the stepping thread, or hold the
        same lock around both (the server does).
        """
        mgr = self.manager
        layout = mgr.layout
        groups = []
        for g in self.spec.groups:
            pool = mgr.allocator.pools[g.group_id]
            groups.append(
                {
                    "group_id": g.group_id,
                    "kind": g.spec.label,
                    "num_layers": len(g.layers),
                    "page_bytes": layout.pages[g.group_id].page_bytes,
                    "pages_used": pool.num_used_pages,
                    "pages_cached": pool.num_cached_pages,
                    "pages_free": pool.num_free_pages,
                    "chunks": pool.num_owned_chunks,
                }
            )
        queries, hits = mgr.stats.query_tokens, mgr.stats.hit_tokens
        snapshots = mgr.recurrent[0].num_snapshots_taken if mgr.recurrent else 0
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting) + len(self._inbox),
            "num_requests_finished": self.num_finished,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generated_tokens,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "state_snapshots_taken": snapshots,
            "state_page_copies": self.runner.num_page_copies,
            "state_pages_used": sum(
                mgr.allocator.pools[g.group_id].num_used_pages
                for g in self.spec.groups
                if g.is_recurrent
            ),
            "pages_evicted": sum(mgr.allocator.num_evicted_pages),
            "cache_memory_bytes": layout.total_bytes,
            "chunk_bytes": layout.chunk_bytes,
            "num_chunks": layout.num_chunks,
            "free_chunks": mgr.allocator.arena.num_free_chunks,
            "max_model_len": self.max_model_len,
            "block_size": self.config.block_size,
            "groups": groups,
        }

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

import collections
import contextlib
import logging
import random
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridkv.core.manager import CacheConfig, CacheManager
from hybridkv.engine.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    EngineConfig,
    loader_cache_dtype,
)
from hybridkv.engine.decode_burst import ForwardTimes, burst_length, plan_burst
from hybridkv.engine.detokenizer import IncrementalDetokenizer, whole_text
from hybridkv.engine.gc_heap import collector_paused, freeze_startup_heap
from hybridkv.engine.generation_defaults import default_sampling
from hybridkv.engine.host_memory import keep_freed_memory
from hybridkv.engine.inputs import InputProcessor, PromptType
from hybridkv.engine.logits_processors import RowContext
from hybridkv.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from hybridkv.engine.prompt_logprobs import chunk_prompt_logprobs
from hybridkv.engine.runner import ModelRunner, StepLogits
from hybridkv.engine.sampler import (
    NO_TOKEN_ALLOWED,
    SampledToken,
    SamplingFailure,
    is_plain_greedy,
    sample,
)
from hybridkv.engine.spec_decode.rejection import verify
from hybridkv.engine.spec_decode.setup import SpeculativeSetup
from hybridkv.engine.spec_decode.speculator import SpecDecodeStats
from hybridkv.engine.startup import (
    cache_budget,
    capacity_plan,
    choose_max_model_len,
    log_capacity,
    plan_command,
    read_chat_template,
    weight_memory_limit,
)
from hybridkv.engine.stopping import append_and_check, final_text
from hybridkv.engine.structured_output import GrammarMatcher, StructuredOutputManager
from hybridkv.models.loader import load_model
from hybridkv.models.tokenizer import Tokenizer
from hybridkv.ops.compiled import running_eagerly
from hybridkv.sched.request import Sequence
from hybridkv.sched.sampling_params import RequestOutputKind, SamplingParams
from hybridkv.sched.scheduler import ScheduledChunk, Scheduler

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine"]


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
    # Per sequence index, made at its first sampled token (see _detokenizer). Here, not on
    # the Sequence: text is the engine's business, and the scheduler's Sequence stays free
    # of tokenizers; like the matchers, it lives as long as the request, preemption included.
    detokenizers: dict[int, IncrementalDetokenizer] = field(default_factory=dict)
    # vLLM's shape: None at position 0, then {token id: Logprob} per prompt token
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_prompt_logprobs: int = 0  # positions filled so far (of len(prompt) - 1)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


class LLMEngine:
    """The serving engine of one model: scheduler, cache manager, runner and sampler."""

    def __init__(self, config: EngineConfig) -> None:
        with collector_paused():  # start-up's objects all live on (gc_heap)
            self._start(config)
        freeze_startup_heap()  # no collection walks the start-up heap while serving

    def _start(self, config: EngineConfig) -> None:
        """Load the model, plan and allocate the cache, compile: everything but the
        garbage collector's part of start-up (``__init__``)."""
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()  # no page faults for the same buffers every step
        if config.trust_remote_code:
            logger.warning(
                "trust_remote_code is accepted for vLLM command lines, but no code from the "
                "checkpoint ever runs here: its architecture must be one hybridkv implements"
            )
        weight_limit = weight_memory_limit(config, self.device)  # the draft's included
        loaded = load_model(
            config.model,
            dtype=config.dtype,
            device=config.device,
            kv_dtype=loader_cache_dtype(config.kv_cache_dtype),
            ssm_dtype=loader_cache_dtype(config.mamba_ssm_cache_dtype),
            tokenizer_dir=config.tokenizer,
            pack_weights=config.pack_weights,
            matmul_dtype=config.cpu_matmul_dtype,
            weight_memory_limit=weight_limit,
        )
        self.model_config = loaded.config
        self.spec = loaded.spec
        self.tokenizer: Tokenizer | None = loaded.tokenizer
        if config.chat_template is not None:
            self._set_chat_template(config.chat_template)
        self.dtype = loaded.dtype
        self.vocab_size = int(loaded.config.get("vocab_size") or 0)
        # speculative decoding: a draft model's layers get pages in the same cache
        self.speculative = SpeculativeSetup.load(config, loaded, weight_limit)
        self.generation_defaults = default_sampling(
            config.generation_config, Path(config.model), config.override_generation_config
        )
        self.default_sampling_params()  # a bad default is a start-up error, not a 500 later
        model = loaded.model.to(self.device)
        budget = cache_budget(config, self.device)
        self.manager = CacheManager(
            self.speculative.cache_spec,
            CacheConfig(
                memory_bytes=budget.bytes,
                block_tokens=config.block_size,
                enable_prefix_caching=config.enables_prefix_caching,
                checkpoint=config.checkpoint_policy,
                eviction=config.eviction_policy,
                eviction_alpha=config.eviction_alpha,
            ),
        )
        native = self.spec.max_model_len or self.model_config.get("max_position_embeddings")
        cache_spec = self.speculative.cache_spec  # with a draft model's layers, if any
        length = choose_max_model_len(
            config, self.manager.layout, cache_spec, int(native) if native else None, budget
        )
        self.max_model_len = length.tokens
        self.capacity = capacity_plan(config, cache_spec, budget, length.tokens)
        self.capacity_report = log_capacity(
            self.capacity, plan_command(config, self.spec, budget, length.tokens), length, budget
        )
        self.eos_token_ids = set(self.tokenizer.eos_token_ids if self.tokenizer else [])
        if not self.eos_token_ids and self.model_config.get("eos_token_id") is not None:
            eos = self.model_config["eos_token_id"]
            self.eos_token_ids = set(eos if isinstance(eos, list) else [eos])
        self.structured: StructuredOutputManager | None = None
        if self.tokenizer is not None:
            self.structured = StructuredOutputManager(
                self.tokenizer, self.vocab_size, sorted(self.eos_token_ids)
            )
        self.inputs = InputProcessor(
            self.tokenizer, self.vocab_size, self.max_model_len, self.structured
        )
        self.runner = ModelRunner(
            model,
            self.speculative.cache_spec,
            self.manager.layout,
            self.device,
            poison_arena=config.poison_cache,
        )
        self.speculator = self.speculative.speculator(self.manager, self.runner)
        with running_eagerly() if config.enforce_eager else contextlib.nullcontext():
            self.runner.warm_up_compiled()  # compiled ops compile now, not while serving
            proposer = self.speculator.proposer if self.speculator is not None else None
            draft_warm_up = getattr(proposer, "warm_up_compiled", None)
            if callable(draft_warm_up):  # a draft model's layers too
                draft_warm_up()
        budget_tokens = config.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        self.scheduler = Scheduler(
            self.manager, max_num_seqs=config.max_num_seqs, max_num_batched_tokens=budget_tokens
        )
        self._rng = random.Random(config.seed)
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()
        self._inbox: list[_Request] = []
        self._abort_inbox: list[str] = []
        self._pending_ids: set[str] = set()
        self._order = 0
        self.num_finished = 0
        self.finished_by_reason: collections.Counter[str] = collections.Counter()
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.num_steps = 0
        self.num_burst_forwards = 0  # forwards of decode bursts past each round's first
        # seconds per forward of the recent rounds of decodes alone, which set how long a
        # decode burst may be (decode_burst.burst_length)
        self._forward_times = ForwardTimes()
        budget_ms = config.decode_burst_budget_ms
        self._burst_budget_s = None if budget_ms is None else budget_ms / 1000

    @classmethod
    def from_model(cls, model: str, **options: Any) -> LLMEngine:
        return cls(EngineConfig(model=str(model), **options))

    def _set_chat_template(self, template: str) -> None:
        if self.tokenizer is None:
            raise ValueError("chat_template given, but the model has no tokenizer")
        self.tokenizer.set_chat_template(read_chat_template(template))

    def default_sampling_params(self, **fields: Any) -> SamplingParams:
        """vLLM's defaults, then the generation config's, then ``fields``.

        Raises:
            ValueError: a value SamplingParams rejects (naming the field).
        """
        return SamplingParams(**(self.generation_defaults | fields))

    # ------------------------------------------------------------------ requests

    def validate_request(
        self, prompt: PromptType, params: SamplingParams
    ) -> tuple[str | None, list[int]]:
        """Every check ``add_request`` makes except the id: (text, token ids) of the prompt.

        Public so a caller can check a whole batch before queueing any of it (``LLM`` does;
        the peer benchmark ``bench_engines.py`` does). The checks live in
        :meth:`InputProcessor.validate`.

        Raises:
            ValueError: the request would be refused by ``add_request``.
        """
        return self.inputs.validate(prompt, params)

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
        text, ids = self.inputs.validate(prompt, params)
        self.queue_validated(request_id, text, ids, params, arrival_time=arrival_time)

    def queue_validated(
        self,
        request_id: str,
        text: str | None,
        ids: list[int],
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
    ) -> None:
        """:meth:`add_request` for a prompt :meth:`validate_request` accepted with
        ``params``: (``text``, ``ids``) is what it returned. A batch API that checks every
        request before queueing any (``LLM``) so tokenizes each prompt once, not twice.

        Raises:
            ValueError: a duplicate id.
        """
        bad_words = self.inputs.bad_words_ids(params)
        matchers = self.inputs.grammar_matchers(params)
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
            if params.prompt_logprobs is not None:
                self._inbox[-1].prompt_logprobs = [None] * len(ids)
                seqs[0].needs_prompt_logits = len(ids) > 1

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
        if self.config.enforce_eager:
            with running_eagerly():
                return self._step()
        return self._step()

    def _step(self) -> list[RequestOutput]:
        outputs = self._drain_inbox()
        if self.speculator is not None:
            self.speculator.plan(self.scheduler.running, self._draft_limit)
        else:
            plan_burst(
                self.scheduler.running,
                burst_length(
                    self.config.decode_burst, self._forward_times.typical, self._burst_budget_s
                )
                if self._may_burst()
                else 1,
                self.max_model_len,
                lambda seq: is_plain_greedy(self._row_context(seq)),
            )
        sched = self.scheduler.schedule()
        if self.speculator is not None:
            for seq in sched.preempted:
                self.speculator.restart(seq.seq_id)
        touched: dict[str, _Request] = {}
        for seq in sched.rejected:
            req = self._requests[seq.request_id]
            req.error = (
                f"the request does not fit in the cache ({self.capacity.memory_bytes} bytes) "
                f"even alone"
            )
            touched[req.request_id] = req
        if sched.chunks:
            self.num_steps += 1
            try:
                started = time.perf_counter()
                if self.speculator is not None:
                    self.speculator.fill(sched.chunks)
                failed_after: set[int] = set()
                forwards = 1 + max(c.num_burst_tokens for c in sched.chunks)
                as_planned = True  # a burst cut by a stop times fewer rows a forward
                if forwards > 1:
                    burst = self.runner.execute_burst(
                        sched.chunks,
                        self.manager,
                        [self._row_context(c.seq).stop_ids for c in sched.chunks],
                        end_at_first_stop=bool(self.scheduler.waiting),
                    )
                    sampled, failed_after = burst.sampled(sched.chunks)
                    as_planned = burst.widths == [1 + c.num_burst_tokens for c in sched.chunks]
                    forwards = burst.forwards
                    self.num_burst_forwards += forwards - 1
                else:
                    logits = self.runner.execute(
                        sched.chunks, self.manager, self._prompt_logit_chunks(sched.chunks)
                    )
                    self._record_prompt_logprobs(sched.chunks, logits, touched)
                    sampled = self._sample(sched.chunks, logits.last)
                if as_planned and all(c.known_end - c.start == 1 for c in sched.chunks):
                    self._forward_times.add((time.perf_counter() - started) / forwards)
                if self.speculator is not None:  # what verification costs, measured
                    self.speculator.observe_step(sched.chunks, time.perf_counter() - started)
            except Exception as exc:  # never leave sequences holding pages after a crash
                logger.exception("model step failed")
                for chunk in sched.chunks:
                    req = self._requests[chunk.seq.request_id]
                    req.error = f"model step failed: {exc}"
                    self.scheduler.finish(chunk.seq, "abort")
                    touched[req.request_id] = req
            else:
                self._postprocess(sched.chunks, sampled, touched, failed_after)
        for req in touched.values():
            if req.finished:
                outputs.append(self._finish_request(req))
            elif req.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(self._output(req))
        return outputs

    @staticmethod
    def _prompt_logit_chunks(chunks: list[ScheduledChunk]) -> set[int]:
        """Chunks whose every row's logits are wanted: prompt positions of a sequence that
        still owes prompt log-probabilities."""
        return {
            i
            for i, c in enumerate(chunks)
            if c.seq.needs_prompt_logits and c.start < len(c.seq.prompt_token_ids) - 1
        }

    def _record_prompt_logprobs(
        self, chunks: list[ScheduledChunk], logits: StepLogits, touched: dict[str, _Request]
    ) -> None:
        for i, rows in logits.rows.items():
            seq = chunks[i].seq
            req = self._requests[seq.request_id]
            assert req.prompt_logprobs is not None and req.params.prompt_logprobs is not None
            k = req.params.prompt_logprobs
            for e in chunk_prompt_logprobs(rows, seq.prompt_token_ids, chunks[i].start, k):
                if req.prompt_logprobs[e.position] is None:
                    req.num_prompt_logprobs += 1
                entry = {t: Logprob(lp, r, self._piece(t)) for t, lp, r in e.top}
                entry.setdefault(e.token_id, Logprob(e.logprob, e.rank, self._piece(e.token_id)))
                req.prompt_logprobs[e.position] = entry
            if req.num_prompt_logprobs >= len(seq.prompt_token_ids) - 1:
                seq.needs_prompt_logits = False  # from now on it may resume from the cache
            touched[req.request_id] = req

    def _sample(
        self, chunks: list[ScheduledChunk], logits: torch.Tensor
    ) -> dict[int, list[SampledToken] | SamplingFailure]:
        """The tokens of every chunk that reached the end of its known tokens: one, or
        after a speculative chunk the drafts it keeps and the token that follows them."""
        if not any(c.num_draft_tokens for c in chunks):  # one row each: sample as a batch
            rows = [i for i, c in enumerate(chunks) if c.samples]
            if not rows:
                return {}
            contexts = [self._row_context(chunks[i].seq) for i in rows]
            return {
                i: t if isinstance(t, SamplingFailure) else [t]
                for i, t in zip(rows, sample(logits[rows], contexts), strict=True)
            }
        values = logits.float().cpu()
        results: dict[int, list[SampledToken] | SamplingFailure] = {}
        row = 0
        for i, chunk in enumerate(chunks):
            rows = values[row : row + 1 + chunk.num_draft_tokens]
            row += 1 + chunk.num_draft_tokens
            if not chunk.samples:
                continue
            drafts = chunk.seq.draft_token_ids[: chunk.num_draft_tokens]
            try:
                results[i] = verify(rows, drafts, self._row_context(chunk.seq))
            except (ValueError, RuntimeError) as exc:  # this sequence only
                results[i] = SamplingFailure(str(exc))
        return results

    def _may_burst(self) -> bool:
        """Whether this round may run decode bursts (hybridkv.engine.decode_burst): the
        decode graph is on, and nobody waits who could be admitted (a burst round admits
        nobody; with every seat taken nobody could be)."""
        scheduler = self.scheduler
        seats_taken = len(scheduler.running) >= scheduler.max_num_seqs
        return self.runner.bursts and (not scheduler.waiting or seats_taken)

    def _draft_limit(self, seq: Sequence) -> int:
        """Drafts a sequence may verify in one step: none under a grammar (its mask after
        a draft would need the matcher advanced through it); never past max_model_len
        (the drafts' KV must fit) nor past max_tokens (they could never be kept)."""
        req = self._requests[seq.request_id]
        if req.matchers and req.matchers[seq.index] is not None:
            return 0
        room = self.max_model_len - seq.num_tokens
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_outputs - 1)
        return room

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
        sampled: dict[int, list[SampledToken] | SamplingFailure],
        touched: dict[str, _Request],
        failed_after: Collection[int] = (),
    ) -> None:
        """Append each chunk's samples up to a stop and advance it; a chunk in
        ``failed_after`` (a burst's forward without a token after them) then fails its
        sequence unless they stopped it."""
        now = time.monotonic()
        for i, chunk in enumerate(chunks):
            seq = chunk.seq
            req = self._requests[seq.request_id]
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            tokens = sampled.get(i)
            if isinstance(tokens, SamplingFailure):  # this sequence alone fails
                req.error = f"sampling failed for this request: {tokens.message}"
                self.scheduler.finish(seq, "abort")
                touched[req.request_id] = req
                continue
            if tokens is None:
                self.scheduler.advance(chunk)
                continue
            if self.speculator is not None:
                if chunk.num_draft_tokens:
                    self.speculator.record(chunk, len(tokens) - 1)
                else:
                    self.speculator.record_plain(chunk, tokens[0].token_id)
            req.metrics.record_token(now)
            kept, stop = self._append(seq, req, [t.token_id for t in tokens])
            self.num_generated_tokens += kept
            for token in tokens[:kept]:  # kept drafts or a burst's tokens, up to a stop
                self._record_logprobs(seq, token)
            if stop is None and i in failed_after:
                req.error = f"sampling failed for this request: {NO_TOKEN_ALLOWED}"
                stop = ("abort", None)
            self.scheduler.advance(chunk)
            if stop is not None:
                self.scheduler.finish(seq, *stop)
            touched[req.request_id] = req

    def _append(
        self, seq: Sequence, req: _Request, token_ids: list[int]
    ) -> tuple[int, tuple[str, int | str | None] | None]:
        """Append the step's tokens to ``seq`` up to a stop: (how many, the stop or None).
        The stop rules, then under a grammar its accept of each token. The text grows with
        them, unless it is decoded once at the end (:meth:`_text_at_finish`)."""
        detokenizer = None if self._text_at_finish(req) else self._detokenizer(seq, req)

        def check(ids: list[int]) -> tuple[int, tuple[str, int | str | None] | None]:
            return append_and_check(
                seq,
                ids,
                detokenizer=detokenizer,
                eos_token_ids=self.eos_token_ids,
                max_model_len=self.max_model_len,
            )

        matcher = req.matchers[seq.index] if req.matchers else None
        if matcher is None:
            return check(token_ids)
        for count, token_id in enumerate(token_ids, 1):  # one: a grammar's rows never
            _, stop = check([token_id])  # speculate nor burst
            if stop is not None:
                return count, stop
            try:
                matcher.accept(token_id)
            except ValueError as exc:
                req.error = f"sampling failed for this request: {exc}"
                return count, ("abort", None)
            if matcher.is_finished:  # the grammar is complete: nothing may follow
                seq.text = final_text(detokenizer)
                return count, ("stop", None)
        return len(token_ids), None

    def _text_at_finish(self, req: _Request) -> bool:
        """Whether ``req``'s text is decoded once, when it finishes: nobody reads it before
        (``RequestOutputKind.FINAL_ONLY``), and neither do stop strings nor a grammar. One
        id at a time cost ~3 us a token (64 x 32 tokens of the tiny model: ~6.5 ms)."""
        return (
            req.params.output_kind is RequestOutputKind.FINAL_ONLY
            and self.tokenizer is not None
            and not req.params.stop_strings
            and not any(m is not None for m in req.matchers)
        )

    def _detokenizer(self, seq: Sequence, req: _Request) -> IncrementalDetokenizer | None:
        """The sequence's detokenizer, made at its first sampled token; None without a
        tokenizer (the text stays "")."""
        if self.tokenizer is None:
            return None
        detokenizer = req.detokenizers.get(seq.index)
        if detokenizer is None:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, seq.prompt_token_ids, seq.params.skip_special_tokens
            )
            req.detokenizers[seq.index] = detokenizer
        return detokenizer

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
            prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
        )

    def _finish_request(self, req: _Request) -> RequestOutput:
        req.metrics.finished_time = time.monotonic()
        if self._text_at_finish(req):
            assert self.tokenizer is not None
            for seq in req.seqs:
                seq.text = whole_text(
                    self.tokenizer,
                    seq.prompt_token_ids,
                    seq.output_token_ids,
                    seq.params.skip_special_tokens,
                )
        if self.speculator is not None:
            for seq in req.seqs:
                self.speculator.forget(seq.seq_id)
        self._requests.pop(req.request_id, None)
        with self._lock:
            self._pending_ids.discard(req.request_id)
        self.num_finished += 1
        reason = "error" if req.error else (req.seqs[0].finish_reason or "abort")
        self.finished_by_reason[reason] += 1
        return self._output(req)

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache, as vLLM's ``reset_prefix_cache``; call it between steps.

        Every cached KV block and state snapshot is freed, so no later prompt hits what was
        computed before (benchmarks time cold and warm turns alike this way). Unlike vLLM,
        which refuses while requests run, running requests go on unaffected: they keep
        their block tables and live states, lose the snapshots they held, and publish
        their blocks again as they run. Counters are totals since start and keep counting.

        Returns:
            True (vLLM's return value: the reset took place).
        """
        freed = self.manager.reset_prefix_cache()
        logger.info("prefix cache reset: %d cached pages freed", freed)
        return True

    # ------------------------------------------------------------------ stats

    def _spec_decode_stats(self) -> dict[str, Any]:
        """vLLM's speculative-decoding counters (zeros without speculation)."""
        stats = self.speculator.stats if self.speculator else SpecDecodeStats()
        return {"speculative_config": self.speculative.config_dict, **stats.as_dict()}

    def stats(self) -> dict[str, Any]:
        """Counters, cache occupancy and the capacity plan (what /metrics and ``LLM.stats()``
        report).

        Reads state that ``step`` changes: call it from the stepping thread, or hold the
        same lock around both (the server and ``LLM`` do).
        """
        usage = self.manager.usage()
        layout = self.manager.layout
        queries, hits = usage.prefix_query_tokens, usage.prefix_hit_tokens
        state_groups = [g for g in usage.groups if g.group_id in self.manager.state_groups]
        used_bytes = sum(g.pages_used * g.page_bytes for g in usage.groups)
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting) + len(self._inbox),
            "num_requests_finished": self.num_finished,
            "requests_finished_by_reason": dict(self.finished_by_reason),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "num_burst_forwards": self.num_burst_forwards,
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generated_tokens,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "prefix_cache_hybrid_misses": usage.prefix_hybrid_miss_tokens,
            "kv_cache_usage": used_bytes / layout.total_bytes if layout.total_bytes else 0.0,
            "state_snapshots_taken": usage.snapshots_taken,
            "state_snapshots_kept": state_groups[0].pages_cached if state_groups else 0,
            "state_snapshots_dropped": usage.snapshots_dropped,
            "state_snapshots_evicted": state_groups[0].pages_evicted if state_groups else 0,
            "state_page_copies": self.runner.num_page_copies,
            "state_pages_used": usage.state_pages_used,
            "pages_evicted": usage.pages_evicted,
            "cache_memory_bytes": layout.total_bytes,
            "chunk_bytes": layout.chunk_bytes,
            "num_chunks": layout.num_chunks,
            "free_chunks": usage.free_chunks,
            "max_model_len": self.max_model_len,
            "block_size": self.config.block_size,
            **self._spec_decode_stats(),
            "groups": [
                {
                    "group_id": g.group_id,
                    "kind": g.kind,
                    "num_layers": g.num_layers,
                    "page_bytes": g.page_bytes,
                    "pages_used": g.pages_used,
                    "pages_cached": g.pages_cached,
                    "pages_free": g.pages_free,
                    "chunks": g.chunks,
                    "pages_evicted": g.pages_evicted,
                }
                for g in usage.groups
            ],
            "capacity": self.capacity.to_json(),
            "capacity_report": list(self.capacity_report),
        }

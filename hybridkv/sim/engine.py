"""A simulated scheduler on the real :class:`CacheManager`: the serving loop without a model.

Each step (nano-vllm's shape: schedule, run, postprocess)::

    schedule     running requests first, oldest first: a decode token or the next prefill
                 chunk (cut by the token budget and by ``CacheManager.next_split``, so the
                 chunk ends on a checkpoint); when ``allocate`` returns None the newest
                 running request is preempted (freed, recomputed later) until it fits.
                 Then waiting requests, in order, while budget, seats and memory last.
    run          no model: the cost model turns the batch into seconds.
    postprocess  commit what was computed; a request whose prompt is done samples its
                 next token from the trace; a finished request is freed (its pages stay
                 cached) and releases the turn that waits on it.

Time has two clocks: ``step`` (arrivals and think times in the trace count steps) and
simulated seconds (the sum of step costs; an idle step lasts ``idle_step_s``). TTFT is
the seconds from the start of the step a request became eligible to the end of the step
that sampled its first token.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from hybridkv.core.groups.base import ReqId
from hybridkv.core.manager import Allocation, CacheManager
from hybridkv.sim.cost import CostModel
from hybridkv.sim.traces import Trace, TraceRequest


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    max_num_batched_tokens: int = 8192  # token budget of one step
    max_num_seqs: int = 128  # running requests at most
    idle_step_s: float = 0.01  # length of a step with nothing to run
    check_integrity: bool = False  # CacheManager.check_integrity() after every step (tests)


@dataclass(slots=True, eq=False)
class _Req:
    trace: TraceRequest
    order: int
    tokens: list[int]  # prompt, plus outputs sampled before a preemption
    num_computed: int = 0
    num_outputs: int = 0
    eligible_s: float = 0.0
    admitted: bool = False

    @property
    def req_id(self) -> ReqId:
        return ReqId(self.trace.req_id)


@dataclass(kw_only=True)
class SimResult:
    """What one design did with one trace."""

    name: str
    memory_bytes: int
    num_requests: int = 0
    num_rejected: int = 0  # could not fit even alone
    prompt_tokens: int = 0
    hit_tokens: int = 0
    output_tokens: int = 0
    ttfts_s: list[float] = field(default_factory=list)
    busy_s: float = 0.0  # seconds of steps that ran something
    elapsed_s: float = 0.0
    num_steps: int = 0
    preemptions: int = 0
    snapshots_taken: int = 0
    snapshots_kept: int = 0  # taken minus dropped by retention (eviction not counted)
    pages_evicted: int = 0
    max_concurrency: int = 0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ttft_mean_s(self) -> float:
        return sum(self.ttfts_s) / len(self.ttfts_s) if self.ttfts_s else 0.0

    @property
    def ttft_p95_s(self) -> float:
        if not self.ttfts_s:
            return 0.0
        ordered = sorted(self.ttfts_s)
        return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]

    @property
    def throughput_tok_s(self) -> float:
        """Output tokens per second of busy engine time."""
        return self.output_tokens / self.busy_s if self.busy_s else 0.0

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "memory_bytes": self.memory_bytes,
            "token_hit_rate": round(self.token_hit_rate, 6),
            "hit_tokens": self.hit_tokens,
            "prompt_tokens": self.prompt_tokens,
            "ttft_mean_s": round(self.ttft_mean_s, 6),
            "ttft_p95_s": round(self.ttft_p95_s, 6),
            "throughput_tok_s": round(self.throughput_tok_s, 3),
            "preemptions": self.preemptions,
            "snapshots_taken": self.snapshots_taken,
            "snapshots_kept": self.snapshots_kept,
            "pages_evicted": self.pages_evicted,
            "max_concurrency": self.max_concurrency,
            "rejected": self.num_rejected,
        }


_Batch = list[tuple[_Req, int, int]]  # (request, start, num_new_tokens)


class Simulator:
    """Replays one trace through one CacheManager."""

    def __init__(
        self,
        trace: Trace,
        manager: CacheManager,
        cost: CostModel,
        config: EngineConfig | None = None,
        name: str = "design",
    ) -> None:
        self.mgr = manager
        self.cost = cost
        self.config = config or EngineConfig()
        self.result = SimResult(name=name, memory_bytes=manager.config.memory_bytes)
        self.result.num_requests = len(trace.requests)
        self.step = 0
        self.now = 0.0
        self._pending: list[tuple[int, int, _Req]] = []  # (eligible step, order, request)
        self._ready: deque[_Req] = deque()
        self._running: list[_Req] = []
        self._waiters: dict[str, list[_Req]] = {}
        self._num_done = 0
        for order, t in enumerate(trace.requests):
            req = _Req(trace=t, order=order, tokens=list(t.prompt_token_ids))
            if t.after is None:
                heapq.heappush(self._pending, (t.arrival_step, order, req))
            else:
                self._waiters.setdefault(t.after, []).append(req)

    # ------------------------------------------------------------------ loop

    def run(self, on_request_done: Callable[[], None] | None = None) -> SimResult:
        total = self.result.num_requests
        while self._num_done < total:
            self._release_due()
            if not self._running and not self._ready:
                self._idle_until(self._pending[0][0])
                continue
            batch, num_copies = self._schedule()
            if batch:
                seconds = self.cost.step([(start, n) for _, start, n in batch], num_copies).seconds
                self.result.busy_s += seconds
            else:
                seconds = self.config.idle_step_s
            self.now += seconds
            done = self._postprocess(batch)
            if self.config.check_integrity:
                self.mgr.check_integrity()
            self.step += 1
            for _ in range(done):
                if on_request_done is not None:
                    on_request_done()
        return self._finish()

    def _release_due(self) -> None:
        while self._pending and self._pending[0][0] <= self.step:
            _, _, req = heapq.heappop(self._pending)
            req.eligible_s = self.now
            self._ready.append(req)

    def _idle_until(self, step: int) -> None:
        self.now += max(0, step - self.step) * self.config.idle_step_s
        self.step = max(self.step, step)

    # ------------------------------------------------------------------ schedule

    def _schedule(self) -> tuple[_Batch, int]:
        budget = self.config.max_num_batched_tokens
        batch: _Batch = []
        copies = 0
        for req in list(self._running):
            if budget == 0:
                break
            if req not in self._running:  # preempted earlier in this step
                continue
            start = req.num_computed
            end = self.mgr.next_split(
                req.req_id, start, start + min(len(req.tokens) - start, budget)
            )
            alloc = self._allocate_running(req, end - start)
            if alloc is not None:
                batch.append((req, start, end - start))
                budget -= end - start
                copies += len(alloc.snapshots) + len(alloc.restores)
        while self._ready and budget > 0 and len(self._running) < self.config.max_num_seqs:
            admitted = self._admit(self._ready[0], budget, bool(batch))
            if admitted is None:
                break
            batch.append(admitted[:3])
            budget -= admitted[2]
            copies += admitted[3]
        self.result.max_concurrency = max(self.result.max_concurrency, len(self._running))
        return batch, copies

    def _allocate_running(self, req: _Req, num_tokens: int) -> Allocation | None:
        """Allocate, preempting the newest running request until it fits (maybe req itself)."""
        while True:
            alloc = self.mgr.allocate(req.req_id, num_tokens)
            if alloc is not None:
                return alloc
            victim = self._running[-1]
            self._preempt(victim)
            if victim is req:
                return None

    def _preempt(self, req: _Req) -> None:
        self.mgr.free(req.req_id)
        self._running.remove(req)
        req.num_computed = 0
        self._ready.appendleft(req)
        self.result.preemptions += 1

    def _admit(self, req: _Req, budget: int, busy: bool) -> tuple[_Req, int, int, int] | None:
        rid = req.req_id
        self.mgr.add_request(rid, req.tokens)
        hit = self.mgr.find_hit(rid)
        start = hit.num_tokens
        end = self.mgr.next_split(rid, start, start + min(len(req.tokens) - start, budget))
        alloc = self.mgr.allocate(rid, end - start, hit)
        if alloc is None:
            self.mgr.free(rid)
            if not busy and not self._running:  # alone and still too big: give up on it
                self._ready.popleft()
                self.result.num_rejected += 1
                self._complete(req)
            return None
        self._ready.popleft()
        self._running.append(req)
        cached = self.mgr.num_cached_tokens(rid)
        if not req.admitted:
            req.admitted = True
            self.result.prompt_tokens += len(req.trace.prompt_token_ids)
            self.result.hit_tokens += cached
        return req, cached, end - start, len(alloc.snapshots) + len(alloc.restores)

    # ------------------------------------------------------------------ postprocess

    def _postprocess(self, batch: _Batch) -> int:
        done = self._num_done
        for req, start, num_tokens in batch:
            req.num_computed = start + num_tokens
            if req.num_computed < len(req.tokens):  # a prefill chunk, more to come
                self.mgr.commit(req.req_id, req.num_computed)
                continue
            outputs = req.trace.output_token_ids
            token = outputs[req.num_outputs]
            req.num_outputs += 1
            req.tokens.append(token)
            self.result.output_tokens += 1
            if req.num_outputs == 1:
                self.result.ttfts_s.append(self.now - req.eligible_s)
            self.mgr.commit(req.req_id, req.num_computed, [token])
            if req.num_outputs == len(outputs):
                self.mgr.free(req.req_id)
                self._running.remove(req)
                self._complete(req)
        return self._num_done - done

    def _complete(self, req: _Req) -> None:
        self._num_done += 1
        for waiter in self._waiters.pop(req.trace.req_id, []):
            step = max(waiter.trace.arrival_step, self.step + 1 + waiter.trace.think_steps)
            heapq.heappush(self._pending, (step, waiter.order, waiter))

    def _finish(self) -> SimResult:
        r = self.result
        r.elapsed_s = self.now
        r.num_steps = self.step
        if self.mgr.recurrent:
            group = self.mgr.recurrent[0]  # snapshots are taken in all groups or none
            r.snapshots_taken = group.num_snapshots_taken
            r.snapshots_kept = group.num_snapshots_taken - group.num_snapshots_dropped
        r.pages_evicted = sum(self.mgr.allocator.num_evicted_pages)
        return r

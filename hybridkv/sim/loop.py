"""The serving loop without a model: the engine's own scheduler on the real CacheManager.

Each step (nano-vllm's shape: schedule, run, postprocess)::

    schedule     :class:`hybridkv.sched.scheduler.Scheduler`, the one the engine runs:
                 running requests first (a decode token or the next prefill chunk, cut by
                 the token budget and by ``CacheManager.next_split``; the newest running
                 request is preempted when ``allocate`` fails), then waiting ones, FCFS.
    run          no model: the cost model turns the batch into seconds.
    postprocess  a request whose prompt is done "samples" its next token from the trace;
                 a finished request is freed (its pages stay cached) and releases the turn
                 that waits on it.

Because the scheduler is shared, the simulator and the engine make the same decisions on
the same trace (tests/engine/test_engine_matches_simulator.py checks their hits agree).

Time has two clocks: ``step`` (arrivals and think times in the trace count steps) and
simulated seconds (the sum of step costs; an idle step lasts ``idle_step_s``). TTFT is
the seconds from the start of the step a request became eligible to the end of the step
that sampled its first token.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from hybridkv.core.ids import ReqId
from hybridkv.core.manager import CacheManager
from hybridkv.sched.request import Sequence
from hybridkv.sched.sampling_params import SamplingParams
from hybridkv.sched.scheduler import ScheduledChunk, Scheduler
from hybridkv.sim.cost import CostModel
from hybridkv.sim.traces import Trace, TraceRequest


@dataclass(frozen=True, kw_only=True, slots=True)
class SimConfig:
    """Knobs of the simulated serving loop (the real engine's are EngineConfig's)."""

    max_num_batched_tokens: int = 8192  # token budget of one step
    max_num_seqs: int = 128  # running requests at most
    idle_step_s: float = 0.01  # length of a step with nothing to run
    check_integrity: bool = False  # CacheManager.check_integrity() after every step (tests)


@dataclass(slots=True, eq=False)
class _Req:
    trace: TraceRequest
    order: int
    seq: Sequence
    eligible_s: float = 0.0
    counted: bool = False  # prompt and hit tokens are counted at the first admission

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


class Simulator:
    """Replays one trace through one CacheManager."""

    def __init__(
        self,
        trace: Trace,
        manager: CacheManager,
        cost: CostModel,
        config: SimConfig | None = None,
        name: str = "design",
    ) -> None:
        self.mgr = manager
        self.cost = cost
        self.config = config or SimConfig()
        self.scheduler = Scheduler(
            manager,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
        )
        self.result = SimResult(name=name, memory_bytes=manager.config.memory_bytes)
        self.result.num_requests = len(trace.requests)
        self.step = 0
        self.now = 0.0
        self._pending: list[tuple[int, int, _Req]] = []  # (eligible step, order, request)
        self._reqs: dict[ReqId, _Req] = {}
        self._waiters: dict[str, list[_Req]] = {}
        self._num_done = 0
        for order, t in enumerate(trace.requests):
            params = SamplingParams(max_tokens=len(t.output_token_ids), ignore_eos=True)
            seq = Sequence(
                seq_id=ReqId(t.req_id),
                request_id=t.req_id,
                index=0,
                prompt_token_ids=list(t.prompt_token_ids),
                params=params,
            )
            req = _Req(trace=t, order=order, seq=seq)
            self._reqs[seq.seq_id] = req
            if t.after is None:
                heapq.heappush(self._pending, (t.arrival_step, order, req))
            else:
                self._waiters.setdefault(t.after, []).append(req)

    # ------------------------------------------------------------------ loop

    def run(self, on_request_done: Callable[[], None] | None = None) -> SimResult:
        total = self.result.num_requests
        while self._num_done < total:
            self._release_due()
            if self.scheduler.num_unfinished == 0:
                self._idle_until(self._pending[0][0])
                continue
            chunks, num_copies = self._schedule()
            if chunks:
                work = [(c.start, c.num_tokens) for c in chunks]
                seconds = self.cost.step(work, num_copies).seconds
                self.result.busy_s += seconds
            else:
                seconds = self.config.idle_step_s
            self.now += seconds
            done = self._postprocess(chunks)
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
            self.scheduler.add(req.seq)

    def _idle_until(self, step: int) -> None:
        self.now += max(0, step - self.step) * self.config.idle_step_s
        self.step = max(self.step, step)

    # ------------------------------------------------------------------ schedule

    def _schedule(self) -> tuple[list[ScheduledChunk], int]:
        out = self.scheduler.schedule()
        self.result.preemptions += len(out.preempted)
        for seq in out.rejected:  # could not fit even alone: give up on it
            self.result.num_rejected += 1
            self._complete(self._reqs[seq.seq_id])
        copies = 0
        for chunk in out.chunks:
            copies += len(chunk.allocation.snapshots) + len(chunk.allocation.restores)
            req = self._reqs[chunk.seq.seq_id]
            if not req.counted:
                req.counted = True
                self.result.prompt_tokens += len(req.trace.prompt_token_ids)
                self.result.hit_tokens += chunk.seq.num_cached_tokens
        running = len(self.scheduler.running)
        self.result.max_concurrency = max(self.result.max_concurrency, running)
        return out.chunks, copies

    # ------------------------------------------------------------------ postprocess

    def _postprocess(self, chunks: list[ScheduledChunk]) -> int:
        done = self._num_done
        for chunk in chunks:
            seq = chunk.seq
            if not chunk.samples:  # a prefill chunk, more to come
                self.scheduler.advance(chunk)
                continue
            req = self._reqs[seq.seq_id]
            outputs = req.trace.output_token_ids
            seq.output_token_ids.append(outputs[seq.num_outputs])
            self.scheduler.advance(chunk)
            self.result.output_tokens += 1
            if seq.num_outputs == 1:
                self.result.ttfts_s.append(self.now - req.eligible_s)
            if seq.num_outputs == len(outputs):
                self.scheduler.finish(seq, "length")
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
        usage = self.mgr.usage()
        r.snapshots_taken = usage.snapshots_taken
        r.snapshots_kept = usage.snapshots_taken - usage.snapshots_dropped
        r.pages_evicted = usage.pages_evicted
        return r

"""The engine's side of speculation: who drafts how much, the proposals, the statistics.

Each step, before scheduling, every running sequence that is decoding is given a number of
drafts (:meth:`Speculator.plan`); the scheduler verifies them with the sequence's last
token as one chunk (or a plain decode if the scratch states do not fit); once the step is
scheduled the drafts are filled in (:meth:`Speculator.fill`: the n-gram proposer already
has them, a draft model runs now); after the verification forward :meth:`record` counts
what was kept.

How many drafts (the fallback when acceptance is low). Two things are estimated online:

- **What a verification step costs** (:class:`StepCosts`), in plain decode steps: the
  engine times every step made only of decodes and verifications (proposer, forward and
  sampling) and fits ``cost = 1 + fixed + per_draft * drafts`` to the verification steps
  by exponentially weighted least squares, against a moving average of the plain steps.
  ``fixed`` is real and large on CPU: a verification chunk takes the multi-token paths
  of attention and of the recurrent ops (chunk layouts, the chunked delta rule, per-row
  state captures) and verifies row by row in Python, so with the tests' tiny Qwen3.5 and
  4 requests a step verifying a few drafts costs about 1.5 plain decode steps and each
  further draft 0.01-0.04 more (the ``fixed`` and ``per draft`` columns of
  ``benchmarks/spec_decode.py``). Measured online rather than calibrated at
  start-up: a calibration would add start-up time and measure one moment of a shared
  machine, while the moving averages follow the load and the batch the engine really
  runs. Until there are observations the fit starts from those measured figures.
- **How often a draft is kept** (per sequence, decayed so that it follows the text):
  a step with ``s`` drafts emits ``1 + a + ... + a^s`` tokens on average when each draft
  is kept with probability ``a`` (Leviathan et al. 2023, eq. 1). An n-gram proposer's
  guess costs nothing, so on every plain step its first draft is also compared with the
  token the step produced (a *shadow* trial; also unbiased at temperature > 0, where a
  point-mass draft is kept with the probability the target samples it): a sequence with
  nothing to copy learns it without verifying anything. Every sequence starts
  pessimistic (``a = 1/3``, below what pays). A draft model's guess costs a forward, so
  without shadow trials a sequence whose drafts do not pay probes with one draft after 1,
  2, 4, ... 64 idle steps.

The drafts of a step are chosen together, because the fixed cost is paid once per step:
each sequence takes the ``s`` with the largest gain ``E(s) - 1 - lam * per_draft * s``
over a plain decode, where ``lam`` is the step's tokens per cost (Dinkelbach's iteration
for the best ratio), and the step verifies only if the gains pay ``lam * fixed``. vLLM has
no such rule for n-gram drafts (it always verifies a match).

Exploration. The cost fit only learns from verification steps, so a few noisy ones that
fit a steep line would stop speculation for good: nothing verified, nothing corrects it.
When the fitted costs decline drafts that the prior costs (the measured figures above)
would verify, the step verifies the prior's choice anyway after 1, 2, 4, ... 64 such
declined steps (reset once the fit itself verifies again). Each exploring step adds a
point to the fit, so a fit pushed up by noise comes back; a fit that is right costs at
most one exploring step in 64. Sequences with nothing to copy are declined by the prior
too, so they never explore.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from hybridkv.sched.request import Sequence
from hybridkv.sched.scheduler import ScheduledChunk

DECAY = 0.8  # weight of the past in the acceptance estimate, per trial
PRIOR_KEPT, PRIOR_REJECTED = 0.5, 1.0  # a new sequence starts pessimistic (a = 1/3)
MAX_PROBE_INTERVAL = 64  # declined steps between probes (no free guess) or explorations, at most
# The cost fit's prior, in plain decode steps (measured on the tests' tiny Qwen3.5 with 4
# requests: 0.4-0.6 and 0.01-0.04, benchmarks/README.md, issue 16):
FIXED_COST = 0.5  # a step that verifies anything, over a plain decode step
ROW_COST = 0.05  # each verified draft row
COST_DECAY = 0.95  # weight of the past in the cost fit, per observed step
PRIOR_WEIGHT = 3.0  # the prior counts as this many observed steps, always
RATIO_ITERATIONS = 4  # Dinkelbach iterations (converges in 2-3)


class Proposer(Protocol):
    """Where drafts come from (n-gram lookup, a draft model)."""

    # the first draft can be had without a forward: plain steps test it for free
    free_guess: bool

    def available(self, seq: Sequence, limit: int) -> int:
        """Drafts this proposer can offer ``seq`` now, at most ``limit`` (0: none)."""

    def guess(self, seq_id: str) -> int | None:
        """The first draft of the last :meth:`available` call (free guesses only)."""

    def fill(self, chunks: list[ScheduledChunk]) -> None:
        """Set ``seq.draft_token_ids`` (exactly ``chunk.num_draft_tokens``) of every chunk
        that verifies drafts."""

    def forget(self, seq_id: str) -> None:
        """A sequence finished or restarts: drop what is kept about it."""


@dataclass(slots=True)
class _Acceptance:
    kept: float = PRIOR_KEPT
    rejected: float = PRIOR_REJECTED
    idle_steps: int = 0
    probe_interval: int = 1
    guess: int | None = None  # the free first draft of a plain step, checked after it

    @property
    def rate(self) -> float:
        return self.kept / (self.kept + self.rejected)

    def trial(self, kept: int, rejected: bool) -> None:
        self.kept = DECAY * self.kept + kept
        self.rejected = DECAY * self.rejected + rejected


class StepCosts:
    """A verification step's cost in plain decode steps: ``1 + fixed + per_draft * s``.

    Plain steps (decodes only) keep a moving average of their seconds; every verification
    step adds the point (its drafts, its seconds / that average - 1) to an exponentially
    weighted least-squares line. Two prior points on the line given keep their weight
    (``PRIOR_WEIGHT`` steps, against ~20 for the decayed observations). A few noisy steps
    with a narrow spread of draft counts can still fit a steep line that prices drafts out;
    :class:`Speculator` then explores (module docstring), which feeds the fit new points.
    """

    def __init__(self, fixed: float, per_draft: float, typical_drafts: int) -> None:
        self.plain_seconds: float | None = None
        self._prior = [0.0] * 5  # weight, x, y, xx, xy of the prior points (never decayed)
        for x in (1.0, float(max(2, typical_drafts))):
            self._add(self._prior, x, fixed + per_draft * x, PRIOR_WEIGHT / 2)
        self._seen = [0.0] * 5  # the same sums over the observed steps, decayed
        self.fixed, self.per_draft = fixed, per_draft

    def observe(self, drafts: int, seconds: float) -> None:
        if drafts == 0:
            previous = self.plain_seconds
            self.plain_seconds = seconds if previous is None else 0.9 * previous + 0.1 * seconds
            return
        if self.plain_seconds is None:
            return
        self._seen = [COST_DECAY * v for v in self._seen]
        self._add(self._seen, float(drafts), seconds / self.plain_seconds - 1.0, 1.0)
        w, x, y, xx, xy = (p + v for p, v in zip(self._prior, self._seen, strict=True))
        var = xx / w - (x / w) ** 2
        slope = (xy / w - x * y / w**2) / var if var > 1e-9 else self.per_draft
        self.per_draft = max(0.01, slope)
        self.fixed = max(0.0, y / w - self.per_draft * x / w)

    @staticmethod
    def _add(sums: list[float], x: float, y: float, weight: float) -> None:
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            sums[i] += weight * v


@dataclass(slots=True)
class SpecDecodeStats:
    """vLLM's counters: verification steps with drafts, draft tokens, kept drafts."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        drafts, tokens, kept = self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens
        return {
            "spec_decode_num_drafts": drafts,
            "spec_decode_num_draft_tokens": tokens,
            "spec_decode_num_accepted_tokens": kept,
            "spec_decode_acceptance_rate": kept / tokens if tokens else 0.0,
            "spec_decode_mean_acceptance_length": 1 + kept / drafts if drafts else 0.0,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position),
        }


def expected_gain(rate: float, drafts: int) -> float:
    """Tokens a step with ``drafts`` drafts emits on average beyond a plain decode's one."""
    return sum(rate**i for i in range(1, drafts + 1))


def best_drafts(rate: float, available: int, price: float) -> tuple[int, float]:
    """The draft count in ``[0, available]`` with the largest ``gain - price * s``, and it."""
    best, best_value, gain, power = 0, 0.0, 0.0, 1.0
    for s in range(1, available + 1):
        power *= rate
        gain += power
        if gain - price * s > best_value:
            best, best_value = s, gain - price * s
    return best, best_value


def choose_drafts(offers: list[tuple[float, int]], costs: StepCosts, num_plain: int) -> list[int]:
    """Drafts per offer ``(rate, available)`` for the step with the most tokens per cost.

    ``num_plain``: the step's other decoding sequences (one token each, no drafts).
    Dinkelbach: with ``lam`` the best ratio so far, each sequence takes the draft count
    with the largest ``gain - lam * per_draft * s``; the step verifies if the gains beat
    ``lam * fixed``; ``lam`` becomes that step's ratio, until it stops growing.
    """
    base = float(len(offers) + num_plain)  # tokens of a plain step, at cost 1
    lam, chosen = base, [0] * len(offers)
    for _ in range(RATIO_ITERATIONS):
        picks = [best_drafts(rate, n, lam * costs.per_draft) for rate, n in offers]
        if sum(v for _, v in picks) <= lam * costs.fixed:
            break
        drafts = [s for s, _ in picks]
        tokens = base + sum(expected_gain(r, s) for (r, _), s in zip(offers, drafts, strict=True))
        ratio = tokens / (1.0 + costs.fixed + costs.per_draft * sum(drafts))
        if ratio <= lam:
            break
        lam, chosen = ratio, drafts
    return chosen


class Speculator:
    """Drafting for the engine; one per engine, used from the stepping thread only."""

    def __init__(
        self, proposer: Proposer, num_speculative_tokens: int, cost_per_draft: float
    ) -> None:
        self.proposer = proposer
        self.k = num_speculative_tokens
        self.costs = StepCosts(FIXED_COST, cost_per_draft, num_speculative_tokens)
        # the prior line, never fitted: what exploring steps verify (module docstring)
        self.prior_costs = StepCosts(FIXED_COST, cost_per_draft, num_speculative_tokens)
        self._declined_steps = 0
        self._explore_interval = 1
        self.stats = SpecDecodeStats(accepted_per_position=[0] * num_speculative_tokens)
        self._seqs: dict[str, _Acceptance] = {}
        # verify every draft the proposer offers, paying or not (tests: exercises
        # verification and rollback on text where speculation would back off)
        self.always_verify = False

    def plan(self, running: Iterable[Sequence], limit: Callable[[Sequence], int]) -> None:
        """Give each decoding sequence its number of drafts for the next step."""
        offers: list[tuple[Sequence, _Acceptance, int]] = []
        num_plain = 0
        free = self.proposer.free_guess
        for seq in running:
            seq.num_draft_tokens = 0
            if seq.num_computed != seq.num_tokens - 1:  # prefilling or recomputing
                continue
            acc = self._seqs.setdefault(seq.seq_id, _Acceptance())
            acc.guess = None
            cap = min(self.k, limit(seq))
            available = self.proposer.available(seq, cap) if cap > 0 else 0
            if available == 0:
                num_plain += 1
                continue
            if free:
                acc.guess = self.proposer.guess(seq.seq_id)
            offers.append((seq, acc, available))
        if self.always_verify:
            chosen = [n for _, _, n in offers]
        else:
            chosen = self._choose([(a.rate, n) for _, a, n in offers], num_plain)
        for (seq, acc, _), drafts in zip(offers, chosen, strict=True):
            if drafts > 0:  # pays: no more waiting
                acc.idle_steps, acc.probe_interval = 0, 1
            elif not free:  # no free trials: probe now and then
                acc.idle_steps += 1
                if acc.idle_steps >= acc.probe_interval:
                    acc.idle_steps = 0
                    acc.probe_interval = min(2 * acc.probe_interval, MAX_PROBE_INTERVAL)
                    drafts = 1
            seq.num_draft_tokens = drafts

    def _choose(self, offers: list[tuple[float, int]], num_plain: int) -> list[int]:
        """Drafts per offer by the fitted costs, or by the prior's when exploring."""
        chosen = choose_drafts(offers, self.costs, num_plain)
        if any(chosen):
            self._declined_steps, self._explore_interval = 0, 1
            return chosen
        if not offers:
            return chosen
        prior_choice = choose_drafts(offers, self.prior_costs, num_plain)
        if not any(prior_choice):
            return chosen
        self._declined_steps += 1
        if self._declined_steps < self._explore_interval:
            return chosen
        self._declined_steps = 0
        self._explore_interval = min(2 * self._explore_interval, MAX_PROBE_INTERVAL)
        return prior_choice

    def fill(self, chunks: list[ScheduledChunk]) -> None:
        if any(c.num_draft_tokens for c in chunks):
            self.proposer.fill(chunks)

    def observe_step(self, chunks: list[ScheduledChunk], seconds: float) -> None:
        """A step ran in ``seconds`` (proposer, forward, sampling): feed the cost fit if it
        was made of decodes and verifications only."""
        if any(c.num_tokens != 1 + c.num_draft_tokens or not c.samples for c in chunks):
            return
        self.costs.observe(sum(c.num_draft_tokens for c in chunks), seconds)

    def record(self, chunk: ScheduledChunk, num_kept: int) -> None:
        """``num_kept`` of the chunk's drafts were accepted."""
        drafts = chunk.num_draft_tokens
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += drafts
        stats.num_accepted_tokens += num_kept
        for position in range(num_kept):
            stats.accepted_per_position[position] += 1
        acc = self._seqs.setdefault(chunk.seq.seq_id, _Acceptance())
        acc.trial(num_kept, num_kept < drafts)

    def record_plain(self, chunk: ScheduledChunk, token_id: int) -> None:
        """A decode without drafts produced ``token_id``: check the free guess against it."""
        acc = self._seqs.get(chunk.seq.seq_id)
        if acc is not None and acc.guess is not None:
            acc.trial(int(acc.guess == token_id), acc.guess != token_id)
            acc.guess = None

    def restart(self, seq_id: str) -> None:
        """The sequence was preempted: its pages (a draft model's too) are gone."""
        self.proposer.forget(seq_id)

    def forget(self, seq_id: str) -> None:
        """The sequence finished."""
        self._seqs.pop(seq_id, None)
        self.proposer.forget(seq_id)

"""The trace file: requests with their tokens, arrival steps and turn dependencies.

The JSON shape (shared with other tools, so traces can be exchanged)::

    {"meta": {...},
     "requests": [{"id": "c0-t1",
                   "arrival": 0,                  earliest engine step it may be admitted
                   "after": "c0-t0" | null,       a request that must finish first
                   "think_steps": 0,              steps to wait after that one finishes
                   "prompt_token_ids": [...],     or "prompt": {"random": {"len": L, "seed": S}}
                   "output_token_ids": [...]}]}   or "num_output_tokens": K

``after`` must name a request listed earlier (so dependencies never form a cycle).
Random prompts and outputs are drawn from ``meta.vocab_size`` (default 32000) with a
seeded generator, so a file replays the same tokens on every run.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_VOCAB_SIZE = 32000


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the request and the field."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceRequest:
    req_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    arrival_step: int = 0
    after: str | None = None
    think_steps: int = 0


@dataclass(frozen=True, kw_only=True)
class Trace:
    requests: tuple[TraceRequest, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(r.output_token_ids) for r in self.requests)

    def to_json(self) -> dict[str, Any]:
        return {
            "meta": self.meta,
            "requests": [
                {
                    "id": r.req_id,
                    "arrival": r.arrival_step,
                    "after": r.after,
                    "think_steps": r.think_steps,
                    "prompt_token_ids": list(r.prompt_token_ids),
                    "output_token_ids": list(r.output_token_ids),
                }
                for r in self.requests
            ],
        }


def random_tokens(
    length: int, seed: int | str, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> tuple[int, ...]:
    """``length`` token ids drawn uniformly from the vocabulary; the same for the same seed."""
    rng = random.Random(seed)
    return tuple(rng.randrange(vocab_size) for _ in range(length))


def _int(entry: Mapping[str, Any], key: str, default: int, where: str) -> int:
    value = entry.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TraceError(f"{where}: {key!r} must be a non-negative integer, got {value!r}")
    return value


def _ids(value: Any, key: str, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise TraceError(f"{where}: {key!r} must be a non-empty list of token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise TraceError(f"{where}: {key!r} holds something that is not a token id (int >= 0)")
    return tuple(value)


def _prompt(entry: Mapping[str, Any], where: str, vocab: int) -> tuple[int, ...]:
    if "prompt_token_ids" in entry:
        return _ids(entry["prompt_token_ids"], "prompt_token_ids", where)
    spec = entry.get("prompt")
    rnd = spec.get("random") if isinstance(spec, Mapping) else None
    if not isinstance(rnd, Mapping):
        raise TraceError(
            f"{where}: needs 'prompt_token_ids' or 'prompt': {{'random': {{'len': L, 'seed': S}}}}"
        )
    length = _int(rnd, "len", 0, f"{where}.prompt.random")
    if length == 0:
        raise TraceError(f"{where}.prompt.random: 'len' must be at least 1")
    seed = rnd.get("seed", 0)
    if not isinstance(seed, int | str) or isinstance(seed, bool):
        raise TraceError(f"{where}.prompt.random: 'seed' must be an integer or a string")
    return random_tokens(length, seed, vocab)


def _output(entry: Mapping[str, Any], req_id: str, where: str, vocab: int) -> tuple[int, ...]:
    if "output_token_ids" in entry:
        return _ids(entry["output_token_ids"], "output_token_ids", where)
    if "num_output_tokens" not in entry:
        raise TraceError(f"{where}: needs 'output_token_ids' or 'num_output_tokens'")
    count = _int(entry, "num_output_tokens", 0, where)
    if count == 0:
        raise TraceError(f"{where}: 'num_output_tokens' must be at least 1")
    return random_tokens(count, f"output:{req_id}", vocab)


def _request(entry: Any, index: int, seen: set[str], vocab: int) -> TraceRequest:
    where = f"requests[{index}]"
    if not isinstance(entry, Mapping):
        raise TraceError(f"{where}: must be an object")
    req_id = entry.get("id")
    if not isinstance(req_id, str) or not req_id:
        raise TraceError(f"{where}: 'id' must be a non-empty string")
    where = f"{where} (id {req_id!r})"
    if req_id in seen:
        raise TraceError(f"{where}: duplicate id")
    after = entry.get("after")
    if after is not None and (not isinstance(after, str) or after not in seen):
        raise TraceError(f"{where}: 'after' must name a request listed earlier, got {after!r}")
    return TraceRequest(
        req_id=req_id,
        arrival_step=_int(entry, "arrival", 0, where),
        after=after,
        think_steps=_int(entry, "think_steps", 0, where),
        prompt_token_ids=_prompt(entry, where, vocab),
        output_token_ids=_output(entry, req_id, where, vocab),
    )


def parse_trace(data: Any) -> Trace:
    """Validate a parsed trace document.

    Raises:
        TraceError: the first problem found, naming the request and the field.
    """
    if not isinstance(data, Mapping):
        raise TraceError("a trace is a JSON object with 'meta' and 'requests'")
    meta = data.get("meta", {})
    if not isinstance(meta, Mapping):
        raise TraceError("'meta' must be an object")
    entries = data.get("requests")
    if not isinstance(entries, list) or not entries:
        raise TraceError("'requests' must be a non-empty list")
    vocab = meta.get("vocab_size", DEFAULT_VOCAB_SIZE)
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise TraceError(f"meta.vocab_size must be a positive integer, got {vocab!r}")
    seen: set[str] = set()
    requests: list[TraceRequest] = []
    for index, entry in enumerate(entries):
        request = _request(entry, index, seen, vocab)
        seen.add(request.req_id)
        requests.append(request)
    return Trace(requests=tuple(requests), meta=dict(meta))


def load_trace(path: str | Path) -> Trace:
    """Read and validate a trace file.

    Raises:
        TraceError: unreadable file, invalid JSON or an invalid request.
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path} is not valid JSON: {exc.msg} (line {exc.lineno})") from None
    try:
        return parse_trace(data)
    except TraceError as exc:
        raise TraceError(f"{path}: {exc}") from None


def save_trace(trace: Trace, path: str | Path) -> None:
    """Write a trace with explicit token ids (loads back equal)."""
    Path(path).write_text(json.dumps(trace.to_json(), separators=(",", ":")))

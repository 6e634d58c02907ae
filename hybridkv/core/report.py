"""The startup capacity report: a :class:`~hybridkv.core.planner.Plan` in a few log lines.

What an operator needs before sending traffic (vLLM #40384 asked for it: capacity that does
not count constant-size state groups as tokens): KV token capacity over the attention
groups only, the state slots, the effective concurrency at max_model_len and what binds it,
the padding waste, and what one unified page size (vLLM's sizing) would give in the same
memory. ``serve``, ``LLM`` and ``hybridkv plan`` all print these numbers from the same
:func:`~hybridkv.core.planner.plan`, and the report names the ``hybridkv plan`` command
that reproduces them.
"""

from __future__ import annotations

from hybridkv.core.planner import Plan
from hybridkv.core.units import GIB, MIB

BINDING_WORDS = {
    "max_num_seqs": "max_num_seqs binds",
    "kv_cache": "KV cache binds",
    "state": "state slots bind",
}


def _count(n: int | None) -> str:
    return "unbounded" if n is None else f"{n:,}"


def _seqs(n: int) -> str:
    return f"{n:,} sequence" + ("" if n == 1 else "s")


def concurrency_line(plan: Plan) -> str:
    """The effective concurrency cap at max_model_len, its bounds, and which one binds."""
    c = plan.concurrency
    return (
        f"max concurrency at max_model_len {plan.max_model_len:,}: {_seqs(c.effective)} "
        f"(KV-bound {_count(c.kv_bound)}, state slots {_count(c.state_bound)}, "
        f"max_num_seqs {c.max_num_seqs:,}; {BINDING_WORDS[c.binding]})"
    )


def capacity_lines(
    plan: Plan, *, plan_command: str | None = None, memory_source: str | None = None
) -> list[str]:
    """The report, one line per fact (no trailing newlines).

    ``memory_source``: how the cache size was chosen, shown beside it.
    """
    u = plan.unified
    groups = ", ".join(
        f"{g.kind} x{g.num_layers}: "
        + ("1 sequence" if g.block_tokens is None else f"{g.block_tokens} tokens")
        + f"/page of {g.page_bytes / MIB:,.3g} MiB"
        for g in plan.groups
    )
    source = f" ({memory_source})" if memory_source else ""
    lines = [
        f"cache {plan.memory_bytes / GIB:.3g} GiB{source}: {plan.layout.num_chunks:,} chunks of "
        f"{plan.layout.chunk_bytes / MIB:,.2f} MiB; {groups}",
    ]
    if plan.kv_capacity_tokens is not None and plan.physical_limit_tokens:
        share = plan.kv_capacity_tokens / plan.physical_limit_tokens
        lines.append(
            f"KV capacity (attention groups only): {plan.kv_capacity_tokens:,} tokens with "
            f"{plan.max_num_seqs:,} live states ({100 * share:.2f}% of the physical limit "
            f"{plan.physical_limit_tokens:,})"
        )
    else:
        lines.append("KV capacity: no attention layer, sequence length costs no cache")
    lines.append(concurrency_line(plan))
    lines.append(
        f"padding waste: {plan.padding_waste_bytes / MIB:,.2f} MiB "
        f"({100 * plan.padding_waste_bytes / plan.memory_bytes:.3f}%)"
    )
    unified_kv = "-" if u.kv_capacity_tokens is None else f"{u.kv_capacity_tokens:,}"
    lines.append(
        f"one unified page size (vLLM's sizing) in the same memory: {u.block_tokens}-token "
        f"attention pages, {unified_kv} KV tokens, {_seqs(u.max_concurrency)} of "
        f"{plan.max_model_len:,} at once"
    )
    lines.extend(f"warning: {w}" for w in plan.warnings)
    if plan_command:
        lines.append(f"same numbers: {plan_command}")
    return lines


__all__ = ["BINDING_WORDS", "capacity_lines", "concurrency_line"]

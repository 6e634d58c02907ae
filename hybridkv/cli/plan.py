"""``hybridkv plan``: the capacity report of a model in a memory budget."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from hybridkv.core.model_config import builtin_model_names, load_model_spec
from hybridkv.core.planner import Plan, plan
from hybridkv.core.report import concurrency_line
from hybridkv.core.spec import with_draft
from hybridkv.core.units import GIB, MIB


def add_plan_parser(commands: Any) -> None:
    p = commands.add_parser(
        "plan",
        help="report KV capacity, state slots and waste for a model in a memory budget",
        description="Lay out the cache arena for MODEL and compare it with the physical "
        "limit and with a single unified page size (vLLM's sizing).",
    )
    p.add_argument("model", nargs="?", help="built-in name (see --list), config.json or model dir")
    p.add_argument("--memory-gib", type=float, help="memory given to the cache (not the whole GPU)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="live sequences (default 256)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    p.add_argument("--block-size", type=int, default=16, help="attention tokens per page")
    p.add_argument("--kv-dtype", default=None, help="KV cache dtype (default: model dtype)")
    p.add_argument("--conv-dtype", default=None, help="conv state dtype (default: model dtype)")
    p.add_argument("--ssm-dtype", default=None, help="SSM state dtype (default: family rule)")
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=0,
        help="draft tokens per step (speculative decoding): count their scratch state pages",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        help="a draft model (speculative decoding, config.json or model dir): its layers "
        "get pages in the same arena, with the same cache dtypes",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--list", action="store_true", help="list the built-in model names")
    p.set_defaults(run=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    if args.list:
        print("\n".join(builtin_model_names()))
        return 0
    if not args.model:
        raise ValueError("MODEL is required (a built-in name, a config.json or a model dir)")
    if args.memory_gib is None:
        raise ValueError("--memory-gib is required")
    if not 0 < args.memory_gib < math.inf:  # nan and inf too: int(inf) would raise OverflowError
        raise ValueError(f"--memory-gib must be positive and finite, got {args.memory_gib}")
    dtypes = {"kv_dtype": args.kv_dtype, "conv_dtype": args.conv_dtype, "ssm_dtype": args.ssm_dtype}
    spec = load_model_spec(args.model, **dtypes)
    if args.draft_model:
        spec = with_draft(spec, load_model_spec(args.draft_model, **dtypes))
    result = plan(
        spec,
        int(args.memory_gib * GIB),
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        block_tokens=args.block_size,
        num_speculative_tokens=args.num_speculative_tokens,
    )
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print_plan(result)
    return 0


def _mib(n: int) -> str:
    return f"{n / MIB:,.2f} MiB"


def _tokens(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def print_plan(p: Plan) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"[bold]{p.model}[/]: {p.memory_bytes / GIB:g} GiB cache, block {p.block_tokens} tokens, "
        f"{p.max_num_seqs} live sequences, max_model_len {p.max_model_len:,}"
    )
    console.print(
        f"KV {p.kv_bytes_per_token:,} B/token, state {_mib(p.state_bytes_per_seq)} per sequence"
    )
    groups = Table(title="layer groups (each keeps its natural page size)")
    for col in ("kind", "layers", "page", "tokens/page", "pages/chunk"):
        groups.add_column(col, justify="right")
    for g in p.groups:
        groups.add_row(
            g.kind,
            str(g.num_layers),
            _mib(g.page_bytes),
            "1 sequence" if g.block_tokens is None else str(g.block_tokens),
            str(g.pages_per_chunk),
        )
    console.print(groups)
    held = "live states"
    if p.num_speculative_tokens:
        held = (
            f"live states and {p.num_speculative_tokens} scratch states each "
            f"({p.num_speculative_tokens} draft tokens per step)"
        )
    console.print(
        f"arena: {p.layout.num_chunks:,} chunks of {_mib(p.layout.chunk_bytes)}; "
        f"{p.state_chunks:,} hold the {p.max_num_seqs} sequences' {held}"
    )
    table = Table(title="capacity")
    for col in ("", "hybridkv", "unified page (vLLM sizing)", "physical limit"):
        table.add_column(col, justify="right")
    u = p.unified
    table.add_row("tokens/page (attention)", str(p.block_tokens), str(u.block_tokens), "-")
    table.add_row(
        "KV tokens with live states",
        _tokens(p.kv_capacity_tokens),
        _tokens(u.kv_capacity_tokens),
        _tokens(p.physical_limit_tokens),
    )
    table.add_row(
        f"sequences of {p.max_model_len:,} at once",
        f"{p.max_concurrency:,}",
        f"{u.max_concurrency:,}",
        "-",
    )
    waste = f"{_mib(p.padding_waste_bytes)} ({100 * p.padding_waste_bytes / p.memory_bytes:.3f}%)"
    table.add_row("padding waste", waste, "-", "0")
    console.print(table)
    if p.kv_capacity_tokens and p.physical_limit_tokens:
        ratio = p.kv_capacity_tokens / p.physical_limit_tokens
        console.print(f"KV capacity is {100 * ratio:.3f}% of the physical limit")
    console.print(concurrency_line(p))
    for warning in p.warnings:
        console.print(f"[yellow]warning:[/] {warning}")

"""``hybridkv bench``: replay a named workload on the engine and report what it measured.

The workloads (:mod:`hybridkv.bench.workloads`) are the simulator's traces run for real:
multi-turn chat, agent sessions, requests behind shared system prompts, repeated prompts.
Follow-up turns carry the engine's own replies, so the prefix-cache hit rate is the one a
real conversation gets. Output tokens/s, total tokens/s, time to first token (mean and p95),
the prefix-cache token hit rate and the preemption count are printed, or one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

from hybridkv.bench.workloads import WORKLOADS, BenchResult, build_workload, run_workload, warm_up
from hybridkv.cli.common import build_engine
from hybridkv.cli.engine_args import add_engine_args


def add_bench_parser(commands: Any) -> None:
    p = commands.add_parser(
        "bench",
        help="run a named workload against the engine and report throughput, TTFT, hit rate",
        description="Replay a generated workload on the engine (follow-up turns wait for the "
        "previous reply and include it) and report throughput, time to first token, "
        "prefix-cache hit rate and preemptions. --seed also seeds the workload.",
    )
    add_engine_args(p, model_required=False)
    p.add_argument("--workload", choices=WORKLOADS, default="chat", help="default: chat")
    p.add_argument("--num-requests", type=int, default=32, help="requests in all (default 32)")
    p.add_argument("--no-warm-up", action="store_true", help="time the first step too")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--profile",
        action="store_true",
        help="run under torch.profiler and print where the steps' CPU time goes, by module "
        "and engine stage and by op",
    )
    p.add_argument(
        "--profile-rows", type=int, default=15, help="rows of each profile table (default 15)"
    )
    p.add_argument(
        "--profile-trace", metavar="FILE", help="with --profile: also write a Chrome trace"
    )
    p.set_defaults(run=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    if args.num_requests < 1:
        raise ValueError(f"--num-requests must be at least 1, got {args.num_requests}")
    if args.profile_trace and not args.profile:
        raise ValueError("--profile-trace needs --profile")
    engine = build_engine(args)
    requests = build_workload(args.workload, args.num_requests, engine.vocab_size, args.seed)
    if not args.no_warm_up:
        warm_up(engine, engine.vocab_size)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    columns = (
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with (
        Progress(*columns, console=Console(stderr=True), transient=True) as progress,
        _maybe_profiled(engine, args) as profiles,
    ):
        task = progress.add_task(f"bench {args.workload}", total=len(requests))
        try:
            result = run_workload(engine, requests, on_finish=lambda _: progress.advance(task))
        except RuntimeError as exc:
            raise ValueError(str(exc)) from None
    report = {
        "workload": args.workload,
        "model": engine.config.model,
        **result.to_json(),
        "config": asdict(engine.config),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_result(args.workload, engine.config.model, result)
    if profiles:
        from hybridkv.bench.profile import format_profile

        print(
            format_profile(profiles[0], args.profile_rows),
            file=sys.stderr if args.json else sys.stdout,
        )
    return 0


@contextmanager
def _maybe_profiled(engine: Any, args: argparse.Namespace) -> Iterator[list[Any]]:
    """The profiled block of ``--profile`` (torch.profiler loads only then)."""
    if not args.profile:
        yield []
        return
    from hybridkv.bench.profile import profiled

    with profiled(engine, args.profile_trace) as profiles:
        yield profiles


def print_result(workload: str, model: str, r: BenchResult) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=sys.stdout)
    console.print(
        f"[bold]bench {workload}[/] on {model}: {r.num_requests} requests, "
        f"{r.prompt_tokens:,} prompt tokens ({r.cached_prompt_tokens:,} from the prefix cache), "
        f"{r.output_tokens:,} output tokens, {r.num_steps:,} steps "
        f"(+{r.num_burst_forwards:,} forwards in decode bursts) in {r.elapsed_s:.2f} s"
    )
    table = Table(show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("output tokens/s", f"{r.output_tokens_per_s:,.1f}")
    table.add_row("total tokens/s (prompt + output)", f"{r.total_tokens_per_s:,.1f}")
    table.add_row("time to first token, mean", f"{1000 * r.ttft_mean_s:,.1f} ms")
    table.add_row("time to first token, p95", f"{1000 * r.ttft_p95_s:,.1f} ms")
    table.add_row("time to first token, mean engine steps", f"{r.ttft_mean_steps:.2f}")
    table.add_row(
        "prefix-cache hit rate (tokens)",
        f"{r.prefix_cache_hit_rate:.1%} ({r.prefix_cache_hits:,}/{r.prefix_cache_queries:,})",
    )
    table.add_row("preemptions", f"{r.num_preemptions:,}")
    table.add_row("pages evicted", f"{r.pages_evicted:,}")
    console.print(table)

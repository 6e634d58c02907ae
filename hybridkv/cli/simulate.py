"""``hybridkv simulate``: replay a trace on the real core under several cache designs."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hybridkv.core.units import GIB, MIB
from hybridkv.sim.compare import SWEEP_FACTORS, SimSetup, check_designs, make_setup, run_design
from hybridkv.sim.designs import DESIGNS
from hybridkv.sim.gpus import GPUS
from hybridkv.sim.loop import SimConfig, SimResult
from hybridkv.sim.traces import Trace, TraceError, load_trace, save_trace
from hybridkv.sim.workloads import TRACE_KINDS, builtin_trace


def add_simulate_parser(commands: Any) -> None:
    p = commands.add_parser(
        "simulate",
        help="replay a serving trace on the cache core and compare cache designs",
        description="Drive the real memory core with a trace (no model, no GPU) and a GPU cost "
        "model; report hit rate, TTFT and throughput of each cache design side by side.",
    )
    p.add_argument("--model", help="built-in name (see `hybridkv plan --list`) or config path")
    p.add_argument("--memory-gib", type=float, help="memory given to the cache")
    p.add_argument("--num-kv-bytes", type=int, help="exact cache bytes (instead of --memory-gib)")
    p.add_argument(
        "--trace", default="chat", help=f"{' | '.join(TRACE_KINDS)} or a trace JSON file"
    )
    p.add_argument(
        "--designs",
        nargs="+",
        default=list(DESIGNS),
        metavar="DESIGN",
        help=f"designs to compare (default: all of {', '.join(DESIGNS)})",
    )
    p.add_argument(
        "--gpu", default="H100", help=f"cost model GPU: {', '.join(g.name for g in GPUS.values())}"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of a generated trace")
    p.add_argument("--scale", type=float, default=1.0, help="size of a generated trace (x)")
    p.add_argument("--max-num-seqs", type=int, default=128, help="running requests at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens per step")
    p.add_argument("--save-trace", metavar="PATH", help="write the trace used as JSON")
    p.add_argument("--sweep", action="store_true", help="also run at 1/4x to 4x the budget")
    p.add_argument("--plot", default="simulate-sweep.png", help="PNG written by --sweep")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run_simulate)


def _memory_bytes(args: argparse.Namespace) -> int:
    if (args.memory_gib is None) == (args.num_kv_bytes is None):
        raise ValueError("give exactly one of --memory-gib and --num-kv-bytes")
    if args.num_kv_bytes is not None:
        if args.num_kv_bytes <= 0:
            raise ValueError(f"--num-kv-bytes must be positive, got {args.num_kv_bytes}")
        return int(args.num_kv_bytes)
    if not args.memory_gib > 0:
        raise ValueError(f"--memory-gib must be positive, got {args.memory_gib}")
    return int(args.memory_gib * GIB)


def _trace(args: argparse.Namespace) -> Trace:
    if args.trace in TRACE_KINDS:
        if not args.scale > 0:
            raise ValueError(f"--scale must be positive, got {args.scale}")
        return builtin_trace(args.trace, seed=args.seed, scale=args.scale)
    if not Path(args.trace).exists():
        raise TraceError(f"unknown trace {args.trace!r}: not {', '.join(TRACE_KINDS)} or a file")
    return load_trace(args.trace)


def _designs(raw: Sequence[str]) -> list[str]:
    return check_designs([d for item in raw for d in item.split(",") if d])


def run_simulate(args: argparse.Namespace) -> int:
    if not args.model:
        raise ValueError("--model is required (a built-in name, a config.json or a model dir)")
    memory = _memory_bytes(args)
    designs = _designs(args.designs)
    if args.max_num_seqs < 1 or args.max_num_batched_tokens < 1:
        raise ValueError("--max-num-seqs and --max-num-batched-tokens must be >= 1")
    loop = SimConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
    )
    setup = make_setup(args.model, args.gpu, loop)
    trace = _trace(args)
    if args.save_trace:
        save_trace(trace, args.save_trace)
    budgets = sorted({int(memory * f) for f in SWEEP_FACTORS}) if args.sweep else [memory]
    runs = _run_all(setup, trace, designs, budgets, show_progress=not args.json)
    main = [r for r in runs if r is not None and r.memory_bytes == memory]
    if args.json:
        out: dict[str, Any] = {"designs": [r.to_json() for r in main]}
        if args.sweep:
            out["sweep"] = [r.to_json() for r in runs if r is not None]
        print(json.dumps(out, indent=2))
    else:
        print_results(setup, trace, memory, main)
    if args.sweep:
        plot_sweep([r for r in runs if r is not None], args.plot)
        if not args.json:
            print(f"sweep plot written to {args.plot}")
    return 0


def _run_all(
    setup: SimSetup,
    trace: Trace,
    designs: list[str],
    budgets: list[int],
    show_progress: bool,
) -> list[SimResult | None]:
    """Every (budget, design); a budget a design cannot lay out gives None (sweeps only)."""
    from rich.console import Console
    from rich.progress import Progress

    results: list[SimResult | None] = []
    total = len(designs) * len(budgets) * len(trace.requests)
    with Progress(console=Console(stderr=True), transient=True, disable=not show_progress) as bar:
        task = bar.add_task("simulating", total=total)
        for memory in budgets:
            for design in designs:
                bar.update(task, description=f"{design} @ {memory / GIB:.3g} GiB")
                advance: Callable[[], None] = lambda: bar.advance(task)  # noqa: E731
                try:
                    results.append(run_design(setup, trace, design, memory, advance))
                except ValueError:
                    if len(budgets) == 1:
                        raise
                    results.append(None)
    return results


def print_results(setup: SimSetup, trace: Trace, memory: int, results: list[SimResult]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    model, cost = setup.model, setup.cost
    state_mib = model.state_bytes_per_seq / MIB
    console.print(
        f"[bold]{model.name}[/] on {cost.gpu.name}: {memory / GIB:g} GiB cache; "
        f"KV {model.kv_bytes_per_token:,} B/token, state {state_mib:,.1f} MiB/sequence; "
        f"{cost.model.active_params / 1e9:.3g}B active params"
    )
    console.print(
        f"trace: {len(trace.requests)} requests, {trace.num_prompt_tokens:,} prompt tokens, "
        f"{trace.num_output_tokens:,} output tokens ({trace.meta.get('kind', 'file')})"
    )
    table = Table(title="cache designs on the same trace and memory")
    table.add_column("")
    for r in results:
        table.add_column(r.name, justify="right")
    rows: list[tuple[str, Callable[[SimResult], str]]] = [
        ("token hit rate", lambda r: f"{100 * r.token_hit_rate:.1f}%"),
        ("hit / prompt tokens", lambda r: f"{r.hit_tokens:,} / {r.prompt_tokens:,}"),
        ("snapshots taken / kept", lambda r: f"{r.snapshots_taken:,} / {r.snapshots_kept:,}"),
        ("pages evicted", lambda r: f"{r.pages_evicted:,}"),
        ("TTFT mean", lambda r: f"{r.ttft_mean_s:.3f} s"),
        ("TTFT p95", lambda r: f"{r.ttft_p95_s:.3f} s"),
        ("throughput (output)", lambda r: f"{r.throughput_tok_s:,.0f} tok/s"),
        ("max concurrency", lambda r: f"{r.max_concurrency}"),
        ("preemptions", lambda r: f"{r.preemptions}"),
        ("rejected (too big)", lambda r: f"{r.num_rejected}"),
    ]
    for label, cell in rows:
        table.add_row(label, *(cell(r) for r in results))
    console.print(table)


def plot_sweep(results: list[SimResult], path: str) -> None:
    """Hit rate and mean TTFT against the memory budget, one line per design."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (hit_ax, ttft_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r.name for r in results):
        runs = sorted((r for r in results if r.name == name), key=lambda r: r.memory_bytes)
        gib = [r.memory_bytes / GIB for r in runs]
        hit_ax.plot(gib, [100 * r.token_hit_rate for r in runs], marker="o", label=name)
        ttft_ax.plot(gib, [r.ttft_mean_s for r in runs], marker="o", label=name)
    hit_ax.set(xlabel="cache memory (GiB)", ylabel="token hit rate (%)", xscale="log")
    ttft_ax.set(xlabel="cache memory (GiB)", ylabel="mean TTFT (s)", xscale="log", yscale="log")
    budgets = sorted({r.memory_bytes / GIB for r in results})
    for ax in (hit_ax, ttft_ax):
        ax.minorticks_off()
        ax.set_xticks(budgets, labels=[f"{b:.3g}" for b in budgets])
    hit_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""Recurrent ops: the per-request path they replaced against the batched varlen path.

For each op, on the engine benchmark's shapes (issue 13: small Qwen3-Next, hidden 512,
Gated DeltaNet 4 k-heads / 8 v-heads of dim 64, conv kernel 4; a Bamba-like Mamba2 with 16
heads of 64, d_state 128, chunk 256; a Jamba-like Mamba1 with d_inner 1024, d_state 16),
bf16 inputs and bf16 state pages, one layer call per workload step:

    W1 decode     64 requests x 1 token, states carried
    W1 prefill    64 requests x 128 tokens, fresh
    W3 prefill    32 requests x 50 tokens after a cached prefix (states carried)
    mixed         60 decodes + 4 prefill chunks of 128 tokens (a continuous-batching step)
    verify        64 requests x 5 tokens, states carried (a speculative verification window)

``before`` is the per-request driver of 1b19f17 (decodes gathered into fresh fp32 copies,
each prefill chunk run alone through the naive reference, padded to the chunk size);
``after`` is the ``*_varlen`` op; ``captures`` the same with a state captured after every
16th row of every request (after every row for ``verify``, as speculative decoding asks;
none on decodes). Repeats are interleaved (every path of every case once per round);
printed: median ms with min-max, before/after speedup, the capture overhead
(captures/after - 1), and the minor page faults of one call before and after (median; a
load-independent count of the fresh memory each call touches).

``--padding`` prints a second table instead: the varlen GDN and SSD ops with the chunk
rounded up to a multiple of 1 (no tail padding), 16 (the default) or the op's full chunk
(every tail padded to 64), on the workloads where it matters.

Usage: ``python benchmarks/ops_recurrent.py [--threads 1] [--repeats 7] [--ops gdn,ssd]
[--workloads "W1 decode,mixed"] [--padding]``
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from engine_common import machine_line
from torch import Tensor

from hybridkv.ops import state_layouts
from hybridkv.ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update, causal_conv1d_varlen
from hybridkv.ops.gated_delta_rule import (
    chunk_gated_delta_rule,
    gated_delta_rule_varlen,
    recurrent_gated_delta_rule,
)
from hybridkv.ops.mamba1 import (
    SelectiveScanParams,
    selective_scan,
    selective_scan_varlen,
    selective_state_update,
)
from hybridkv.ops.mamba2 import SSDParams, ssd_chunk_scan, ssd_state_update, ssd_varlen
from hybridkv.ops.paged_state import StateBatch, StateCaptures

DTYPE = torch.bfloat16
WORKLOADS: dict[str, tuple[list[int], bool]] = {  # lens, states carried
    "W1 decode": ([1] * 64, True),
    "W1 prefill": ([128] * 64, False),
    "W3 prefill": ([50] * 32, True),
    "mixed": ([1] * 60 + [128] * 4, True),
    "verify": ([5] * 64, True),
}

# (rows [B] of the one-token requests, their states [B, *state]) -> (y, updated states)
StepFn = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
# (rows of one request, its state [*state] or None for zeros) -> (y, final state)
ScanFn = Callable[[slice, Tensor | None], tuple[Tensor, Tensor]]


def per_request(
    out: Tensor,
    view: Tensor,
    states: StateBatch,
    step: StepFn,
    scan: ScanFn,
    step_dtype=torch.float32,
) -> Tensor:
    """The driver the varlen ops replaced (``ops/paged_state.py: run_on_state_pages`` at
    1b19f17): decodes on a gathered copy, each longer chunk alone."""
    pages, starts, flags = states.pages.tolist(), states.starts, states.has_initial_state
    single = [r for r in range(len(pages)) if starts[r + 1] - starts[r] == 1]
    if single:
        rows = torch.tensor([starts[r] for r in single])
        idx = torch.tensor([pages[r] for r in single])
        state = view[idx].to(step_dtype)
        state[torch.tensor([not flags[r] for r in single])] = 0
        out[rows], state = step(rows, state)
        view[idx] = state.to(view.dtype)
    for r, page in enumerate(pages):
        lo, hi = starts[r], starts[r + 1]
        if hi - lo < 2:
            continue
        out[lo:hi], final = scan(slice(lo, hi), view[page] if flags[r] else None)
        view[page] = final.to(view.dtype)
    return out


@dataclass
class Case:
    """One op on one workload: the three paths and the pages they write."""

    before: Callable[[], object]
    after: Callable[[], object]
    captures: Callable[[], object]
    views: list[Tensor]
    initial: list[Tensor]

    def reset(self) -> None:
        for view, init in zip(self.views, self.initial, strict=True):
            view.copy_(init)


def capture_every(lens: list[int]) -> int:
    """Rows between captures: 16 (block boundaries), every row for verification windows."""
    return 1 if max(lens) <= 8 else 16


def make_batches(lens: list[int], carried: bool, state_pages: int) -> tuple[StateBatch, StateBatch]:
    """(plain, with captures every ``capture_every`` rows of each request) on scrambled pages."""
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    order = torch.randperm(state_pages)
    pages = order[: len(lens)]
    every = capture_every(lens)
    rows = [s + p for s, n in zip(starts, lens, strict=False) for p in range(every - 1, n, every)]
    capture = StateCaptures(torch.tensor(rows), order[len(lens) : len(lens) + len(rows)])
    flags = [carried] * len(lens)
    return StateBatch(starts, pages, flags), StateBatch(starts, pages, flags, capture)


def num_pages(lens: list[int]) -> int:
    return len(lens) + sum(n // capture_every(lens) for n in lens) + 4


def randn(*shape: int, scale: float = 1.0) -> Tensor:
    return (torch.randn(*shape) * scale).to(DTYPE)


def conv_case(lens: list[int], carried: bool, channels: int) -> Case:
    kernel, total = 4, sum(lens)
    x, weight = randn(total, channels), randn(channels, kernel, scale=0.5)
    view = randn(num_pages(lens), channels, kernel - 1)
    plain, captured = make_batches(lens, carried, view.shape[0])

    def step(rows: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        return causal_conv1d_update(x[rows], state, weight, None, "silu"), state

    def scan(rows: slice, init: Tensor | None) -> tuple[Tensor, Tensor]:
        return causal_conv1d_fn(x[rows], weight, None, init, "silu")

    return Case(
        lambda: per_request(torch.empty_like(x), view, plain, step, scan, weight.dtype),
        lambda: causal_conv1d_varlen(x, view, plain, weight, None, "silu"),
        lambda: causal_conv1d_varlen(x, view, captured, weight, None, "silu"),
        [view],
        [view.clone()],
    )


def gdn_case(lens: list[int], carried: bool) -> Case:
    hk, hv, dim, total = 4, 8, 64, sum(lens)
    q, k, v = randn(total, hk, dim), randn(total, hk, dim), randn(total, hv, dim)
    g = -torch.rand(total, hv) * 0.5
    beta = torch.rand(total, hv).to(DTYPE)
    view = randn(num_pages(lens), hv, dim, dim, scale=0.1)
    plain, captured = make_batches(lens, carried, view.shape[0])

    def step(rows: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        picked = (t[rows, None] for t in (q, k, v, g, beta))
        o, final = recurrent_gated_delta_rule(*picked, state)
        return o[:, 0], final

    def scan(rows: slice, init: Tensor | None) -> tuple[Tensor, Tensor]:
        picked = (t[None, rows] for t in (q, k, v, g, beta))
        o, final = chunk_gated_delta_rule(*picked, None if init is None else init[None])
        return o[0], final[0]

    return Case(
        lambda: per_request(torch.empty_like(v), view, plain, step, scan),
        lambda: gated_delta_rule_varlen(q, k, v, g, beta, view, plain),
        lambda: gated_delta_rule_varlen(q, k, v, g, beta, view, captured),
        [view],
        [view.clone()],
    )


def ssd_case(lens: list[int], carried: bool) -> Case:
    heads, head_dim, d_state, total = 16, 64, 128, sum(lens)
    x, dt = randn(total, heads, head_dim), randn(total, heads, scale=0.5)
    B, C = randn(total, 1, d_state), randn(total, 1, d_state)
    params = SSDParams(
        A=-torch.rand(heads) * 4 - 1,
        D=torch.ones(heads),
        dt_bias=torch.zeros(heads),
        chunk_size=256,
    )
    view = randn(num_pages(lens), heads, head_dim, d_state, scale=0.1)
    plain, captured = make_batches(lens, carried, view.shape[0])
    kw = {"D": params.D, "dt_bias": params.dt_bias}

    def step(rows: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        return ssd_state_update(state, x[rows], dt[rows], params.A, B[rows], C[rows], **kw), state

    def scan(rows: slice, init: Tensor | None) -> tuple[Tensor, Tensor]:
        return ssd_chunk_scan(
            x[rows], dt[rows], params.A, B[rows], C[rows], chunk_size=256, initial_state=init, **kw
        )

    return Case(
        lambda: per_request(torch.empty_like(x), view, plain, step, scan),
        lambda: ssd_varlen(x, dt, B, C, params, view, plain),
        lambda: ssd_varlen(x, dt, B, C, params, view, captured),
        [view],
        [view.clone()],
    )


def scan_case(lens: list[int], carried: bool) -> Case:
    d_inner, d_state, total = 1024, 16, sum(lens)
    x, dt, z = randn(total, d_inner), randn(total, d_inner, scale=0.5), randn(total, d_inner)
    B, C = randn(total, d_state), randn(total, d_state)
    params = SelectiveScanParams(
        A=-torch.rand(d_inner, d_state) * 4 - 1, D=torch.ones(d_inner), dt_bias=torch.zeros(d_inner)
    )
    view = randn(num_pages(lens), d_inner, d_state, scale=0.1)
    plain, captured = make_batches(lens, carried, view.shape[0])
    kw = {"D": params.D, "dt_bias": params.dt_bias}

    def step(rows: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        y = selective_state_update(
            state, x[rows], dt[rows], params.A, B[rows], C[rows], z=z[rows], **kw
        )
        return y, state

    def scan(rows: slice, init: Tensor | None) -> tuple[Tensor, Tensor]:
        return selective_scan(
            x[rows], dt[rows], params.A, B[rows], C[rows], z=z[rows], initial_state=init, **kw
        )

    return Case(
        lambda: per_request(torch.empty_like(x), view, plain, step, scan),
        lambda: selective_scan_varlen(x, dt, B, C, z, params, view, plain),
        lambda: selective_scan_varlen(x, dt, B, C, z, params, view, captured),
        [view],
        [view.clone()],
    )


OPS: dict[str, tuple[str, Callable[[list[int], bool], Case]]] = {
    "gdn": ("GDN delta rule (Hv 8, 64x64)", gdn_case),
    "gdn_conv": ("GDN conv1d (C 1024, K 4)", lambda lens, c: conv_case(lens, c, 1024)),
    "ssd": ("Mamba2 SSD (H 16, P 64, N 128)", ssd_case),
    "ssd_conv": ("Mamba2 conv1d (C 1280, K 4)", lambda lens, c: conv_case(lens, c, 1280)),
    "scan": ("Mamba1 scan (Di 1024, N 16)", scan_case),
}
PATHS = ("before", "after", "captures")


def timed(case: Case, path: str) -> tuple[float, int]:
    """(seconds, minor page faults) of one call."""
    case.reset()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    getattr(case, path)()
    seconds = time.perf_counter() - start
    return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def run_rounds(
    cases: dict[tuple[str, str], Case], paths: tuple[str, ...], repeats: int
) -> dict[tuple[str, str, str], list[tuple[float, int]]]:
    """Every path of every case once per round (after one warm-up round)."""
    results: dict[tuple[str, str, str], list[tuple[float, int]]] = {}
    with torch.no_grad():
        for case in cases.values():  # warm-up: layouts, workspace buffers
            for path in paths:
                timed(case, path)
        for _ in range(repeats):
            for key, case in cases.items():
                for path in paths:
                    results.setdefault((*key, path), []).append(timed(case, path))
    return results


def span(runs: list[tuple[float, int]]) -> tuple[float, str]:
    """(median ms, "median (min-max)")."""
    ms = [t * 1e3 for t, _ in runs]
    med = statistics.median(ms)
    return med, f"{med:7.2f} ({min(ms):.1f}-{max(ms):.1f})"


def faults(runs: list[tuple[float, int]]) -> int:
    return int(statistics.median(f for _, f in runs))


def print_table(cases: dict[tuple[str, str], Case], repeats: int) -> None:
    times = run_rounds(cases, PATHS, repeats)
    columns = [("op", 32), ("workload", 11), ("before", -21), ("after", -19), ("speedup", -8)]
    columns += [("captures", -19), ("cost", -6), ("faults before/after", -20)]
    print(" ".join(f"{name:<{w}}" if w > 0 else f"{name:>{-w}}" for name, w in columns))
    for op, work in cases:
        runs = {p: times[(op, work, p)] for p in PATHS}
        (before, before_s), (after, after_s), (capt, capt_s) = (span(runs[p]) for p in PATHS)
        fault_cell = f"{faults(runs['before'])}/{faults(runs['after'])}"
        print(
            f"{OPS[op][0]:32} {work:11} {before_s:>21} {after_s:>19} {before / after:7.2f}x "
            f"{capt_s:>19} {capt / after - 1:+6.0%} {fault_cell:>20}"
        )


PAD_MULTIPLES = (1, 16, 64)


def print_padding_table(ops: list[str], works: list[str], repeats: int) -> None:
    """The varlen op with chunks rounded to each of PAD_MULTIPLES, interleaved.

    A StateBatch builds its layouts on first use and keeps them, so each case is warmed up
    under its multiple and then keeps that chunking.
    """
    cases: dict[tuple[str, str, str], Case] = {}
    default = state_layouts.PAD_MULTIPLE
    try:
        for op in ops:
            for work in works:
                for multiple in PAD_MULTIPLES:
                    state_layouts.PAD_MULTIPLE = multiple
                    case = cases[(op, work, str(multiple))] = OPS[op][1](*WORKLOADS[work])
                    with torch.no_grad():
                        timed(case, "after")
    finally:
        state_layouts.PAD_MULTIPLE = default
    results: dict[tuple[str, str, str], list[tuple[float, int]]] = {}
    with torch.no_grad():
        for _ in range(repeats):
            for key, case in cases.items():
                results.setdefault(key, []).append(timed(case, "after"))
    head = " ".join(f"{'multiple of ' + str(m):>19}" for m in PAD_MULTIPLES)
    print(f"{'op':32} {'workload':11} {head}")
    for op in ops:
        for work in works:
            cells = [span(results[(op, work, str(m))])[1] for m in PAD_MULTIPLES]
            print(f"{OPS[op][0]:32} {work:11} " + " ".join(f"{c:>19}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--ops", default=None, help="comma-separated keys of OPS")
    parser.add_argument("--workloads", default=None, help="comma-separated keys of WORKLOADS")
    parser.add_argument("--padding", action="store_true", help="the chunk padding table")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    ops = args.ops.split(",") if args.ops else (["gdn", "ssd"] if args.padding else list(OPS))
    default_works = ["W3 prefill", "mixed", "verify"] if args.padding else list(WORKLOADS)
    works = args.workloads.split(",") if args.workloads else default_works
    print(machine_line())
    print(f"bf16 inputs and pages; median ms (min-max) of {args.repeats} interleaved repeats\n")
    if args.padding:
        print_padding_table(ops, works, args.repeats)
    else:
        cases = {(op, work): OPS[op][1](*WORKLOADS[work]) for op in ops for work in works}
        print_table(cases, args.repeats)


if __name__ == "__main__":
    main()

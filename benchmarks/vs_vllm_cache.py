"""Prefix-cache hit rates: hybridkv's core against vLLM 0.33's own KV cache manager, same bytes.

The targets of issue 12, checked on its two trace shapes (``shared/anchors/make_trace.py``)::

    A   16 conversations x 6 turns behind a 1024-token system prompt   (-n 16 -t 6)
    B   32 conversations x 2 turns behind an 8192-token system prompt  (-n 32 -t 2
        --system-len 8192 --user-len 256 --reply-len 256)

at 100, 200, 400 and 1000 vLLM blocks' worth of bytes, for each ``--seeds`` value. The
model is Qwen3-Next-80B's per-layer shapes with 24 layers (6 attention + 18 Gated DeltaNet,
bf16; ``shared/anchors/qwen3next24.py``), the one the vLLM driver sizes by default.

vLLM runs through ``shared/anchors/vllm_driver.py`` under its own venv (``--vllm-kv``,
$HYBRIDKV_VLLM_KV or ../venvs/vllm-kv), twice per cell: the default "align" retention
(snapshots where vLLM's scheduler aligns them) and "dense" (every block's state kept). Its
JSON gives the bytes of one vLLM block (one block id across every layer group); hybridkv
gets exactly blocks x that many bytes through ``hybridkv simulate --num-kv-bytes``. Both get
the same batching limits (``--max-num-seqs``, ``--max-num-batched-tokens``).

Printed per trace and seed: the token hit rate (hit tokens / prompt tokens) of vLLM align,
vLLM dense and each hybridkv ``--designs`` entry (a simulator design: ``hybridkv simulate
--help`` lists them, so a new policy can be set beside today's), the ratios hybridkv / vLLM
dense and hybridkv / vLLM align, and issue 12's targets: >= vLLM dense in every cell, and
>= 1.5x vLLM align wherever align is below 0.5. Hit rates do not depend on machine load.
Without the vLLM venv it says so and prints hybridkv's column alone. Raw JSON (traces,
every driver and simulator output, a summary) goes to ``--data-dir`` (default
../anchors-data/vs_vllm_cache/<time>), never into the checkout.

Usage: ``python benchmarks/vs_vllm_cache.py [--seeds 7 8] [--designs hybridkv ...]``.
``--vllm-from <an earlier run's raw JSON directory>`` reuses that run's vLLM outputs for
every cell whose trace is the same (every request and generator parameter) and batching
the same (vLLM's figures are deterministic given those), so a change of hybridkv is
measured in minutes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from anchors_common import (
    anchors_dir,
    data_dir,
    git_head,
    hybridkv_env,
    machine_line,
    mark,
    peer_env,
    peer_python,
    run_logged,
)

# Bytes of one vLLM 0.33 block for the 24-layer model (what its sizing gave on 2026-11-23,
# as in issue 12); used only when the vLLM venv is absent and cannot be asked.
RECORDED_BYTES_PER_BLOCK = 6_684_672
SOURCE_CONFIG = "model_configs/qwen3-next-80b-a3b-instruct.json"  # beside anchors/
ALIGN_TARGET_BELOW = 0.5  # issue 12: >= 1.5x vLLM align wherever align < 0.5
ALIGN_TARGET_RATIO = 1.5


@dataclass(frozen=True)
class TraceShape:
    label: str
    args: tuple[str, ...]  # make_trace.py arguments besides --seed


TRACE_SHAPES = {
    "A": TraceShape(
        "16 conversations x 6 turns, 1024-token system prompt", ("-n", "16", "-t", "6")
    ),
    "B": TraceShape(
        "32 conversations x 2 turns, 8192-token shared system prompt",
        ("-n", "32", "-t", "2", "--system-len", "8192", "--user-len", "256", "--reply-len", "256"),
    ),
}
VLLM_MODES = {"align": (), "dense": ("--retention-interval", "dense")}


@dataclass(frozen=True)
class Cell:
    shape: str
    seed: int
    blocks: int

    @property
    def name(self) -> str:
        return f"{self.shape}-s{self.seed}-b{self.blocks}"


@dataclass
class CellResult:
    num_kv_bytes: int
    vllm: dict[str, float]  # mode -> token hit rate
    hybridkv: dict[str, float]  # design -> token hit rate


@dataclass(frozen=True)
class Setup:
    anchors: Path
    out: Path
    vllm_python: Path | None
    config: Path
    designs: tuple[str, ...]
    batching: tuple[str, ...]  # the same limits for both: --max-num-seqs N ...
    vllm_from: Path | None = None  # an earlier run whose vLLM outputs may be reused


# ----------------------------------------------------------------------------- inputs
def make_trace(setup: Setup, shape: str, seed: int) -> Path:
    path = setup.out / f"trace-{shape}-s{seed}.json"
    cmd = [sys.executable, setup.anchors / "make_trace.py", *TRACE_SHAPES[shape].args]
    run_logged([*cmd, "--seed", str(seed), "-o", path], setup.out / f"{path.stem}.log")
    return path


def make_model_config(anchors: Path, out: Path) -> Path:
    """Qwen3-Next-80B's per-layer shapes with 24 layers: the vLLM driver's default model."""
    path = out / "qwen3next24" / "config.json"
    source = anchors.parent / SOURCE_CONFIG
    run_logged([sys.executable, anchors / "qwen3next24.py", source, path], out / "qwen3next24.log")
    return path


def trace_summary(path: Path) -> str:
    requests = json.loads(path.read_text())["requests"]
    tokens = sum(len(r["prompt_token_ids"]) for r in requests)
    return f"{len(requests)} requests, {tokens:,} prompt tokens"


# ----------------------------------------------------------------------------- runs
def run_vllm(setup: Setup, cell: Cell, mode: str) -> dict[str, Any]:
    """vLLM's KVCacheManager on ``cell``'s trace; the driver's JSON (also kept on disk)."""
    assert setup.vllm_python is not None
    stem = f"vllm-{cell.name}-{mode}"
    reused = reusable_vllm_run(setup, cell, stem)
    if reused is not None:
        (setup.out / f"{stem}.json").write_text(reused)
        return json.loads(reused)
    cmd = [
        setup.vllm_python,
        setup.anchors / "vllm_driver.py",
        "--trace",
        setup.out / f"trace-{cell.shape}-s{cell.seed}.json",
        "--num-blocks",
        str(cell.blocks),
        *VLLM_MODES[mode],
        *setup.batching,
    ]
    stdout = run_logged(cmd, setup.out / f"{stem}.log", env=peer_env())
    (setup.out / f"{stem}.json").write_text(stdout)
    return json.loads(stdout)


def reusable_vllm_run(setup: Setup, cell: Cell, stem: str) -> str | None:
    """The driver's JSON for ``stem`` from the ``--vllm-from`` run, if that run had the same
    trace (every request, and the generator's parameters but its output path) and the same
    batching limits; vLLM's figures are deterministic given those, so only hybridkv needs
    to run again after a change of hybridkv."""
    if setup.vllm_from is None:
        return None
    old, trace = setup.vllm_from, f"trace-{cell.shape}-s{cell.seed}.json"
    if not (old / f"{stem}.json").is_file() or not (old / trace).is_file():
        return None
    if _trace_content(old / trace) != _trace_content(setup.out / trace):
        return None
    args = json.loads((old / "summary.json").read_text())["meta"]["args"]
    batching = ("--max-num-seqs", str(args["max_num_seqs"]))
    batching += ("--max-num-batched-tokens", str(args["max_num_batched_tokens"]))
    return (old / f"{stem}.json").read_text() if batching == setup.batching else None


def _trace_content(path: Path) -> dict[str, Any]:
    trace = json.loads(path.read_text())
    trace["meta"].pop("out", None)
    return trace


def run_hybridkv(setup: Setup, cell: Cell, num_kv_bytes: int) -> dict[str, float]:
    """``hybridkv simulate`` on ``cell``'s trace with exactly ``num_kv_bytes``: design -> rate."""
    stem = f"hybridkv-{cell.name}"
    cmd = [
        sys.executable,
        "-m",
        "hybridkv",
        "simulate",
        "--model",
        setup.config,
        "--trace",
        setup.out / f"trace-{cell.shape}-s{cell.seed}.json",
        "--num-kv-bytes",
        str(num_kv_bytes),
        "--designs",
        *setup.designs,
        *setup.batching,
        "--json",
    ]
    stdout = run_logged(cmd, setup.out / f"{stem}.log", env=hybridkv_env())
    (setup.out / f"{stem}.json").write_text(stdout)
    return {d["name"]: float(d["token_hit_rate"]) for d in json.loads(stdout)["designs"]}


def check_designs(designs: Sequence[str]) -> None:
    """Fail before the long runs if the checkout's simulator lacks one of ``designs``."""
    code = (
        "import sys; from hybridkv.sim.designs import DESIGNS; "
        "bad = [d for d in sys.argv[1:] if d not in DESIGNS]; "
        "sys.exit(f'unknown design(s) {bad}; known: {list(DESIGNS)}' if bad else 0)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *designs], env=hybridkv_env(), capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(done.stderr.strip().splitlines()[-1])


T = TypeVar("T")
K = TypeVar("K")


def run_all(jobs: int, work: dict[K, Callable[[], T]]) -> dict[K, T]:
    """Every callable of ``work``, ``jobs`` at a time (subprocesses: threads suffice)."""
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {key: pool.submit(fn) for key, fn in work.items()}
        return {key: f.result() for key, f in futures.items()}


def bytes_per_block(driver_outputs: Sequence[dict[str, Any]]) -> int:
    """The bytes of one vLLM block, which every driver run must agree on."""
    sizes = {int(j["capacity"]["bytes_per_block"]) for j in driver_outputs}
    if len(sizes) != 1:
        raise RuntimeError(f"vLLM driver runs disagree on bytes per block: {sorted(sizes)}")
    return sizes.pop()


def measure(setup: Setup, cells: list[Cell], jobs: int) -> tuple[dict[Cell, CellResult], int]:
    """Every cell through vLLM (both modes, if present) and then through hybridkv."""
    vllm: dict[tuple[Cell, str], dict[str, Any]] = {}
    if setup.vllm_python is not None:
        work = {
            (cell, mode): (lambda c=cell, m=mode: run_vllm(setup, c, m))
            for cell in cells
            for mode in VLLM_MODES
        }
        vllm = run_all(jobs, work)
    block_bytes = bytes_per_block(list(vllm.values())) if vllm else RECORDED_BYTES_PER_BLOCK
    hkv = run_all(
        jobs,
        {cell: (lambda c=cell: run_hybridkv(setup, c, c.blocks * block_bytes)) for cell in cells},
    )
    results = {
        cell: CellResult(
            num_kv_bytes=cell.blocks * block_bytes,
            vllm={
                mode: float(vllm[cell, mode]["results"]["prefix_hit_rate"])
                for mode in VLLM_MODES
                if (cell, mode) in vllm
            },
            hybridkv=hkv[cell],
        )
        for cell in cells
    }
    return results, block_bytes


# ----------------------------------------------------------------------------- report
def ratio(num: float, den: float) -> str:
    if den > 0:
        return f"{num / den:.2f}x"
    return "inf" if num > 0 else "-"


def width(design: str) -> int:
    return max(10, len(design))


def targets(hkv: float, vllm: dict[str, float]) -> tuple[bool, bool | None]:
    """(>= vLLM dense, >= 1.5x vLLM align where align < 0.5, else None)."""
    dense_met = hkv >= vllm["dense"]
    align = vllm["align"]
    align_met = hkv >= ALIGN_TARGET_RATIO * align if align < ALIGN_TARGET_BELOW else None
    return dense_met, align_met


def print_table(
    title: str, cells: list[Cell], results: dict[Cell, CellResult], designs: Sequence[str]
) -> None:
    with_vllm = bool(results[cells[0]].vllm)
    head = f"  {'blocks':>6s} {'GB':>6s}"
    if with_vllm:
        head += f" {'vLLM align':>10s} {'vLLM dense':>10s}"
    for d in designs:
        head += f" | {d:>{width(d)}s}"
        if with_vllm:
            head += f" {'/dense':>7s} {'/align':>7s} {'>=dense':>7s} {'>=1.5x align':>12s}"
    print(f"\n{title}\n{head}")
    for cell in cells:
        r = results[cell]
        line = f"  {cell.blocks:6d} {r.num_kv_bytes / 1e9:6.2f}"
        if with_vllm:
            line += f" {r.vllm['align']:10.3f} {r.vllm['dense']:10.3f}"
        for d in designs:
            hkv = r.hybridkv[d]
            line += f" | {hkv:{width(d)}.3f}"
            if with_vllm:
                dense_met, align_met = targets(hkv, r.vllm)
                align_mark = "n/a" if align_met is None else mark(align_met)
                line += (
                    f" {ratio(hkv, r.vllm['dense']):>7s} {ratio(hkv, r.vllm['align']):>7s}"
                    f" {mark(dense_met):>7s} {align_mark:>12s}"
                )
        print(line)


def print_verdict(results: dict[Cell, CellResult], designs: Sequence[str]) -> None:
    print("\nissue 12 targets (>= vLLM dense in every cell; >= 1.5x vLLM align where align < 0.5):")
    for d in designs:
        marks = [targets(r.hybridkv[d], r.vllm) for r in results.values()]
        dense = [m[0] for m in marks]
        align = [m[1] for m in marks if m[1] is not None]
        verdict = mark(all(dense) and all(align))
        print(
            f"  {d}: >= dense in {sum(dense)} of {len(dense)} cells, >= 1.5x align in "
            f"{sum(align)} of {len(align)} cells where align < 0.5 -> {verdict}"
        )


def write_summary(
    setup: Setup, results: dict[Cell, CellResult], block_bytes: int, args: argparse.Namespace
) -> Path:
    path = setup.out / "summary.json"
    cells = [
        {"shape": c.shape, "seed": c.seed, "blocks": c.blocks, **vars(r)}
        for c, r in results.items()
    ]
    meta = {
        "hybridkv_commit": git_head(),
        "machine": machine_line(),
        "bytes_per_vllm_block": block_bytes,
        "vllm_python": str(setup.vllm_python) if setup.vllm_python else None,
        "args": vars(args),
    }
    path.write_text(json.dumps({"meta": meta, "cells": cells}, indent=1) + "\n")
    return path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(TRACE_SHAPES), choices=list(TRACE_SHAPES))
    p.add_argument("--seeds", nargs="+", type=int, default=[7], help="trace seeds")
    p.add_argument("--blocks", nargs="+", type=int, default=[100, 200, 400, 1000])
    p.add_argument(
        "--designs",
        nargs="+",
        default=["hybridkv"],
        help="hybridkv simulator designs to compare (see `hybridkv simulate --help`)",
    )
    p.add_argument("--max-num-seqs", type=int, default=64, help="both systems (driver default)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="both systems")
    p.add_argument("--vllm-kv", help="vLLM 0.33 venv or its python ($HYBRIDKV_VLLM_KV)")
    p.add_argument("--anchors-dir", help="shared/anchors ($HYBRIDKV_ANCHORS_DIR)")
    p.add_argument("--data-dir", help="raw JSON goes under here ($HYBRIDKV_ANCHORS_DATA)")
    p.add_argument(
        "--vllm-from",
        help="an earlier run's raw JSON directory: its vLLM outputs are reused for every cell "
        "whose trace and batching are the same",
    )
    p.add_argument("--jobs", type=int, default=2, help="runs at once")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    check_designs(args.designs)
    anchors = anchors_dir(args.anchors_dir)
    out = data_dir(args.data_dir, "vs_vllm_cache")
    batching = ("--max-num-seqs", str(args.max_num_seqs))
    batching += ("--max-num-batched-tokens", str(args.max_num_batched_tokens))
    setup = Setup(
        anchors=anchors,
        out=out,
        vllm_python=peer_python(args.vllm_kv, "HYBRIDKV_VLLM_KV", "vllm-kv"),
        config=make_model_config(anchors, out),
        designs=tuple(args.designs),
        batching=batching,
        vllm_from=Path(args.vllm_from) if args.vllm_from else None,
    )
    print(f"machine: {machine_line()}")
    print(f"hybridkv {git_head()}; raw JSON in {out}")
    if setup.vllm_from is not None:
        print(f"vLLM outputs reused from {setup.vllm_from} where trace and batching are the same")
    if setup.vllm_python is None:
        print(
            "vLLM KV venv not found (--vllm-kv, $HYBRIDKV_VLLM_KV or ../venvs/vllm-kv; "
            "shared/anchors/README.md sets it up): hybridkv's column alone, at "
            f"{RECORDED_BYTES_PER_BLOCK:,} B per block (vLLM 0.33's, recorded)"
        )
    traces = {(s, seed): make_trace(setup, s, seed) for s in args.shapes for seed in args.seeds}
    cells = [Cell(s, seed, b) for (s, seed) in traces for b in sorted(args.blocks)]
    results, block_bytes = measure(setup, cells, args.jobs)
    print(f"model: {setup.config} (24 layers: 6 attention + 18 GDN, bf16)")
    print(f"bytes = blocks x {block_bytes:,} B (one vLLM block); token hit rates")
    for (shape, seed), trace in traces.items():
        title = f"{shape}: {TRACE_SHAPES[shape].label}; seed {seed}: {trace_summary(trace)}"
        mine = [c for c in cells if (c.shape, c.seed) == (shape, seed)]
        print_table(title, mine, results, setup.designs)
    if setup.vllm_python is not None:
        print_verdict(results, setup.designs)
    print(f"\nsummary: {write_summary(setup, results, block_bytes, args)}")


if __name__ == "__main__":
    main()

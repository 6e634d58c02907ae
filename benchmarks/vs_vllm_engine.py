"""Engine speed: hybridkv against vLLM 0.32's CPU engine, same CPU, same model, same work.

The targets of issue 13, measured with ``shared/anchors/bench_engines.py`` (the peers'
harness, run as it is under each engine's own interpreter; it picks the engine with
``--engine``): one process per (engine, workload) builds the engine, serves a warm-up
request and runs one workload, printing one JSON line::

    W1  throughput: 64 x 128-token prompts, 64 tokens out, all at once
    W2  8 chats x 4 turns behind a 300-token system prompt (32-token replies)
    W3  32 requests = one shared 1500-token prefix + 50 tokens, 16 out

The model is the small random Qwen3-Next vLLM's CPU loader accepts (hidden 512, 8 layers =
6 GDN + 2 attention, MoE 8 experts top-2, 41.8M params; ``make_small_qwen3next.py`` +
``add_tokenizer.py``), built once with this interpreter's transformers and cached outside
the checkout. Both engines: bf16, 1 GiB cache, max_num_seqs 64, max_num_batched_tokens
4096, one compute thread (vLLM keeps one core for its engine process).

The runs are interleaved: repeat r runs W1, W2, W3 for both engines in turn (which engine
goes first alternates), with trace seed ``--seed`` + r for both, so a change in the
machine's load hits both alike. Printed per workload: the median and min-max over the
repeats of each engine's figure, the speed ratio hybridkv / vLLM (median and min-max of the
per-repeat ratios, > 1 means hybridkv is faster), hit rates and computed prompt tokens
(load-independent), CPU seconds, the start-up to the first request done, and issue 13's
targets marked met / MISSED. Raw JSON lines go to ``--data-dir`` (default
../anchors-data/vs_vllm_engine/<time>/runs.jsonl); ``--from FILE`` reprints a saved run.

Usage: ``python benchmarks/vs_vllm_engine.py [--repeats 5] [--workloads w1 w2 w3]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from anchors_common import (
    anchors_dir,
    cache_dir,
    data_dir,
    git_head,
    hybridkv_env,
    json_line,
    machine_line,
    mark,
    median_range,
    peer_env,
    peer_python,
    run_logged,
)

WORKLOADS = ("w1", "w2", "w3")
ENGINES = ("hybridkv", "vllm")
Run = dict[str, Any]  # one bench_engines.py JSON line, plus "repeat"


@dataclass(frozen=True)
class SmallModel:
    """make_small_qwen3next.py's arguments; the cached checkpoint's name says them."""

    hidden: int = 512
    layers: str = "LLLALLLA"
    seed: int = 0

    @property
    def name(self) -> str:
        return f"small-qwen3next-h{self.hidden}-{self.layers}-s{self.seed}"


def build_model(anchors: Path, cache: Path, spec: SmallModel) -> Path:
    """The small Qwen3-Next checkpoint with a tokenizer, built once into ``cache``."""
    path = cache / spec.name
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    tmp = Path(tempfile.mkdtemp(prefix=f"{spec.name}.", dir=cache))
    log = cache / f"{spec.name}.log"
    make = [sys.executable, anchors / "make_small_qwen3next.py", tmp, "--hidden", str(spec.hidden)]
    run_logged([*make, "--layers", spec.layers, "--seed", str(spec.seed)], log)
    run_logged([sys.executable, anchors / "add_tokenizer.py", tmp], cache / f"{spec.name}.tok.log")
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


def small_model(model: str | None, anchors: str | None, data: str | None) -> Path:
    """``model`` if given, else the cached small Qwen3-Next, built once (the engine
    benchmarks' shared checkpoint; ``anchors`` and ``data`` as their flags)."""
    if model:
        return Path(model)
    return build_model(anchors_dir(anchors), cache_dir(data), SmallModel())


@dataclass(frozen=True)
class Harness:
    """How to start bench_engines.py for either engine."""

    script: Path
    model: Path
    out: Path
    pythons: dict[str, Path]  # engine -> interpreter (vllm absent: hybridkv alone)
    common: tuple[str, ...]  # options both engines get
    hkv_extra: str
    timeout_s: float

    def run(self, engine: str, workload: str, repeat: int, seed: int) -> Run:
        stem = f"{engine}-{workload}-r{repeat}"
        cmd = [self.pythons[engine], self.script, "--engine", engine, "--workload", workload]
        cmd += ["--model", self.model, "--seed", str(seed), "--tag", f"r{repeat}", *self.common]
        if engine == "hybridkv":
            cmd += ["--hkv-extra", self.hkv_extra]
        if workload == "w1" and repeat == 0:
            cmd += ["--dump", self.out / f"{stem}-outputs.json"]
        env = hybridkv_env() if engine == "hybridkv" else peer_env()
        log = self.out / f"{stem}.log"
        try:
            stdout = run_logged(cmd, log, env=env, timeout_s=self.timeout_s)
            run = json_line(stdout, '{"bench":')
        except RuntimeError as e:
            error = f"{e}: {last_line(log)}"
            return {"bench": workload, "engine": engine, "repeat": repeat, "error": error}
        run["repeat"] = repeat
        if engine == "hybridkv":
            run["hybridkv_commit"] = git_head()  # bench_engines cannot read a worktree's HEAD
        return run


def run_interleaved(
    harness: Harness, workloads: Sequence[str], repeats: int, seed: int, runs_file: Path
) -> list[Run]:
    """Repeat r: each workload on each engine in turn, the first engine alternating."""
    runs: list[Run] = []
    engines = [e for e in ENGINES if e in harness.pythons]
    for r in range(repeats):
        order = engines if r % 2 == 0 else engines[::-1]
        for workload in workloads:
            for engine in order:
                run = harness.run(engine, workload, r, seed + r)
                runs.append(run)
                with open(runs_file, "a") as f:
                    f.write(json.dumps(run) + "\n")
                print(f"  {progress_line(run)}", flush=True)
                if "error" in run and r == 0:
                    print("  stopping: a run of the first repeat failed (a set-up problem)")
                    return runs
    return runs


def last_line(log: Path) -> str:
    """The last non-empty line of a failed run's log: usually the exception."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "(empty log)"


def progress_line(run: Run) -> str:
    head = f"repeat {run['repeat']} {run['bench']} {run['engine']:8s}"
    if "error" in run:
        return f"{head} FAILED: {run['error']}"
    res = run["result"]
    return (
        f"{head} wall {res['wall_s']:7.2f} s, {res['output_tok_s']:7.1f} tok/s, "
        f"hits {res['hit_rate']:.0%}, start-up {run['startup']['first_request_done_s']:.1f} s, "
        f"load {run['load_before'][0]:.1f}"
    )


# ----------------------------------------------------------------------------- report
@dataclass(frozen=True)
class Row:
    label: str
    workload: str | None  # None: every workload's runs (start-up)
    value: Callable[[Run], float]
    fmt: str
    speed: Callable[[float, float], float] | None  # (hybridkv, vllm) -> hybridkv/vLLM speed


def _higher_better(hkv: float, vllm: float) -> float:
    return hkv / vllm


def _lower_better(hkv: float, vllm: float) -> float:
    return vllm / hkv


def _res(key: str) -> Callable[[Run], float]:
    return lambda run: float(run["result"][key])


ROWS = [
    Row("W1 output tok/s", "w1", _res("output_tok_s"), "{:.0f}", _higher_better),
    Row("W1 CPU s", "w1", lambda r: float(r["cpu_s_total"]), "{:.1f}", _lower_better),
    Row("W2 wall s", "w2", _res("wall_s"), "{:.2f}", _lower_better),
    Row("W2 hit rate", "w2", _res("hit_rate"), "{:.0%}", None),
    Row("W2 computed tokens", "w2", _res("computed_tokens"), "{:.0f}", None),
    Row("W2 CPU s", "w2", lambda r: float(r["cpu_s_total"]), "{:.1f}", _lower_better),
    Row("W3 wall s", "w3", _res("wall_s"), "{:.2f}", _lower_better),
    Row("W3 hit rate", "w3", _res("hit_rate"), "{:.0%}", None),
    Row("W3 computed tokens", "w3", _res("computed_tokens"), "{:.0f}", None),
    Row("W3 CPU s", "w3", lambda r: float(r["cpu_s_total"]), "{:.1f}", _lower_better),
    Row(
        "start-up to 1st request done s",
        None,
        lambda r: float(r["startup"]["first_request_done_s"]),
        "{:.1f}",
        _lower_better,
    ),
]

# issue 13: (row label, minimum hybridkv/vLLM speed, what the issue says)
SPEED_TARGETS = [
    ("W1 output tok/s", 1.0, "W1 >= 1.0x vLLM (first milestone 0.5x)"),
    ("W2 wall s", 1.5, "W2 >= 1.5x vLLM in wall time"),
    ("W3 wall s", 1.5, "W3 >= 1.5x vLLM in wall time"),
]
STARTUP_LIMIT_S = 5.0  # issue 13: hybridkv's start-up stays under 5 s for this model
W1_MILESTONE = 0.5


def ok_runs(runs: list[Run], engine: str, workload: str | None) -> list[Run]:
    return [
        r
        for r in runs
        if r["engine"] == engine and "error" not in r and workload in (None, r["bench"])
    ]


def paired_speed(runs: list[Run], row: Row) -> list[float]:
    """Per repeat (and workload), hybridkv/vLLM speed of the two engines' runs side by side."""
    assert row.speed is not None
    vllm = {(r["repeat"], r["bench"]): row.value(r) for r in ok_runs(runs, "vllm", row.workload)}
    speeds = []
    for r in ok_runs(runs, "hybridkv", row.workload):
        other = vllm.get((r["repeat"], r["bench"]))
        if other:
            speeds.append(row.speed(row.value(r), other))
    return speeds


def print_table(runs: list[Run]) -> dict[str, list[float]]:
    """The side-by-side table; returns each row's paired speeds."""
    with_vllm = bool(ok_runs(runs, "vllm", None))
    head = f"  {'':32s} {'hybridkv':>24s}"
    if with_vllm:
        head += f" {'vLLM CPU':>24s} {'hybridkv/vLLM speed':>22s}"
    print(head)
    speeds: dict[str, list[float]] = {}
    for row in ROWS:
        hkv = [row.value(r) for r in ok_runs(runs, "hybridkv", row.workload)]
        if not hkv and not ok_runs(runs, "vllm", row.workload):
            continue  # a workload not run
        line = f"  {row.label:32s} {median_range(hkv, row.fmt):>24s}"
        if with_vllm:
            vllm = [row.value(r) for r in ok_runs(runs, "vllm", row.workload)]
            ratio = "-"
            if row.speed is not None:
                speeds[row.label] = paired_speed(runs, row)
                ratio = median_range(speeds[row.label], "{:.2f}x")
            line += f" {median_range(vllm, row.fmt):>24s} {ratio:>22s}"
        print(line)
    return speeds


def print_targets(runs: list[Run], speeds: dict[str, list[float]]) -> None:
    print("\nissue 13 targets (median of the per-repeat hybridkv/vLLM speeds):")
    for label, minimum, text in SPEED_TARGETS:
        if not speeds.get(label):
            print(f"  {text}: not measured")
            continue
        med = statistics.median(speeds[label])
        line = f"  {text}: {med:.2f}x -> {mark(med >= minimum)}"
        if label.startswith("W1"):
            line += f" (milestone: {mark(med >= W1_MILESTONE)})"
        print(line)
    startup = [float(r["startup"]["first_request_done_s"]) for r in ok_runs(runs, "hybridkv", None)]
    if startup:
        med = statistics.median(startup)
        verdict = mark(med < STARTUP_LIMIT_S)
        print(f"  hybridkv start-up < {STARTUP_LIMIT_S:g} s: {med:.1f} s -> {verdict}")


def print_report(runs: list[Run], out: Path | None) -> None:
    failed = [r for r in runs if "error" in r]
    repeats = len({r["repeat"] for r in runs})
    loads = [r["load_before"][0] for r in runs if "error" not in r]
    commits = sorted({r.get("hybridkv_commit", "?") for r in ok_runs(runs, "hybridkv", None)})
    versions = sorted({r["version"] for r in ok_runs(runs, "vllm", None)})
    print(
        f"\n{repeats} interleaved repeat(s); hybridkv {', '.join(commits) or '-'}; "
        f"vLLM {', '.join(versions) or 'absent'}; "
        f"1-min load average before the workloads: {median_range(loads, '{:.1f}')}"
    )
    print("median (min-max) over the repeats:")
    speeds = print_table(runs)
    if ok_runs(runs, "vllm", None):
        print_targets(runs, speeds)
    if out is not None:
        print_agreement(out)
    for r in failed:
        print(f"FAILED: repeat {r['repeat']} {r['bench']} {r['engine']}: {r['error']}")


def print_agreement(out: Path) -> None:
    """Greedy W1 outputs of repeat 0, hybridkv vs vLLM (bench_engines.py --compare)."""
    a, b = out / "hybridkv-w1-r0-outputs.json", out / "vllm-w1-r0-outputs.json"
    script = out / "bench_engines.py"
    if not (a.exists() and b.exists() and script.exists()):
        return
    stdout = run_logged([sys.executable, script, "--compare", a, b], out / "compare.log")
    c = json.loads(stdout)
    print(
        f"\nW1 greedy outputs, repeat 0 (random weights, bf16): first token equal in "
        f"{c['first_token_agree']:.0%}, first 8 in {c['first8_agree']:.0%}, all 64 in "
        f"{c['all_agree']:.0%} of {c['requests']} requests"
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--seed", type=int, default=0, help="trace seed of repeat 0 (+1 each repeat)")
    p.add_argument("--kv-gib", type=float, default=1.0, help="cache memory, both engines")
    p.add_argument("--hkv-extra", default="{}", help="extra hybridkv LLM options as JSON")
    p.add_argument("--model", help="an existing checkpoint instead of the cached small one")
    p.add_argument("--vllm-cpu", help="vLLM CPU venv or its python ($HYBRIDKV_VLLM_CPU)")
    p.add_argument("--anchors-dir", help="shared/anchors ($HYBRIDKV_ANCHORS_DIR)")
    p.add_argument(
        "--data-dir", help="raw JSON and the checkpoint go here ($HYBRIDKV_ANCHORS_DATA)"
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run at most")
    p.add_argument("--from", dest="from_file", help="reprint the report of a saved runs.jsonl")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.from_file:
        path = Path(args.from_file)
        print_report([json.loads(line) for line in path.read_text().splitlines()], path.parent)
        return
    anchors = anchors_dir(args.anchors_dir)
    out = data_dir(args.data_dir, "vs_vllm_engine")
    shutil.copy(anchors / "bench_engines.py", out / "bench_engines.py")  # what was run
    model = small_model(args.model, args.anchors_dir, args.data_dir)
    pythons = {"hybridkv": Path(sys.executable)}
    vllm = peer_python(args.vllm_cpu, "HYBRIDKV_VLLM_CPU", "vllm-cpu")
    if vllm is None:
        print(
            "vLLM CPU venv not found (--vllm-cpu, $HYBRIDKV_VLLM_CPU or ../venvs/vllm-cpu; "
            "shared/anchors/README.md sets it up): hybridkv alone"
        )
    else:
        pythons["vllm"] = vllm
    common = ("--kv-gib", f"{args.kv_gib:g}", "--max-num-seqs", "64")
    common += ("--max-num-batched-tokens", "4096", "--threads", "1")
    harness = Harness(
        script=out / "bench_engines.py",
        model=model,
        out=out,
        pythons=pythons,
        common=common,
        hkv_extra=args.hkv_extra,
        timeout_s=args.timeout,
    )
    print(f"machine: {machine_line()}")
    print(f"model {model}; raw JSON lines in {out / 'runs.jsonl'}")
    runs = run_interleaved(harness, args.workloads, args.repeats, args.seed, out / "runs.jsonl")
    print_report(runs, out)
    print(f"\nmachine at the end: {machine_line()}")


if __name__ == "__main__":
    main()

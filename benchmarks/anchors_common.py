"""What the side-by-side benchmarks against the peers share (no torch, no hybridkv import).

The peers (vLLM's KV cache manager, vLLM's CPU engine) live in their own virtual
environments beside the checkout, and the scripts that drive them in ``shared/anchors/``
(``../shared/anchors/README.md`` from the main checkout says how to set them up). None of it
is part of the repository: the benchmarks find it on disk, run it as a subprocess with the
peer's own interpreter, and only read the JSON it prints. Nothing here copies peer code.

Each location can be given on the command line or by an environment variable; by default
the first ancestor directory of the checkout that holds it is used, which finds
``/work/venvs/vllm-kv`` from the main checkout ``/work/main`` and from a worktree
``/work/wt/<name>`` alike.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

ANCHORS_ENV = "HYBRIDKV_ANCHORS_DIR"  # shared/anchors: vllm_driver.py, make_trace.py, ...
DATA_ENV = "HYBRIDKV_ANCHORS_DATA"  # where raw JSON and built checkpoints go


def beside_checkout(relpath: str) -> Path | None:
    """``relpath`` under the nearest ancestor of the checkout that has it, else None."""
    for parent in ROOT.parents:
        candidate = parent / relpath
        if candidate.exists():
            return candidate
    return None


def anchors_dir(flag: str | None) -> Path:
    """The peers' driver scripts: --anchors-dir, $HYBRIDKV_ANCHORS_DIR or ../shared/anchors.

    Raises:
        SystemExit: nowhere to be found (the benchmarks cannot run without them).
    """
    given = flag or os.environ.get(ANCHORS_ENV)
    path = Path(given) if given else beside_checkout("shared/anchors")
    if path is None or not (path / "make_trace.py").exists():
        raise SystemExit(
            f"anchor scripts not found (looked for {given or '../shared/anchors'}); "
            f"give --anchors-dir or set {ANCHORS_ENV}"
        )
    return path


def peer_python(flag: str | None, env: str, venv_name: str) -> Path | None:
    """A peer venv's interpreter: the flag, then $env, then ../venvs/<venv_name>; None if absent.

    The flag and the variable may name the venv directory or its python.
    """
    given = flag or os.environ.get(env)
    venv = Path(given) if given else beside_checkout(f"venvs/{venv_name}")
    if venv is None:
        return None
    python = venv if venv.is_file() else venv / "bin" / "python"
    return python if python.exists() else None


def data_dir(flag: str | None, name: str) -> Path:
    """A fresh directory for one run's raw output: <data>/<name>/<UTC time>.

    <data> is --data-dir, $HYBRIDKV_ANCHORS_DATA, ../anchors-data beside the checkout, or
    a temporary directory: never inside the checkout (raw JSON is not committed).
    """
    given = flag or os.environ.get(DATA_ENV)
    base = Path(given) if given else beside_checkout("anchors-data")
    if base is None:
        base = Path(tempfile.gettempdir()) / "hybridkv-anchors-data"
    run = base / name / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    run.mkdir(parents=True, exist_ok=True)
    return run


def cache_dir(flag: str | None) -> Path:
    """Where built artefacts (checkpoints, model configs) are kept between runs."""
    given = flag or os.environ.get(DATA_ENV)
    base = Path(given) if given else beside_checkout("anchors-data")
    if base is None:
        base = Path(tempfile.gettempdir()) / "hybridkv-anchors-data"
    path = base / "cache"
    path.mkdir(parents=True, exist_ok=True)
    return path


def git_head() -> str:
    """Short commit of the checkout under test, '+dirty' when the package has local changes.

    Only ``hybridkv/`` and ``pyproject.toml`` count: edits to benchmarks or docs during a
    run do not change the code measured.
    """
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "hybridkv", "pyproject.toml"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return head + ("+dirty" if dirty else "")


@contextmanager
def worktree_at(ref: str) -> Iterator[Path]:
    """A detached git worktree of this checkout at ``ref``, removed on the way out: the
    code an ``--against REF`` side of a benchmark runs (its package first on PYTHONPATH)."""
    with tempfile.TemporaryDirectory() as tmp:
        worktree = Path(tmp) / "against"
        git = ["git", "-C", str(ROOT)]
        subprocess.run([*git, "worktree", "add", "-q", "--detach", str(worktree), ref], check=True)
        try:
            yield worktree
        finally:
            subprocess.run([*git, "worktree", "remove", "--force", str(worktree)], check=False)


@contextmanager
def checkouts(against: str | None) -> Iterator[dict[str, Path]]:
    """The code each side of an ``--against`` benchmark runs: this checkout, labelled with
    its commit, and with ``against`` a worktree at that ref (:func:`worktree_at`)."""
    codes = {f"this ({git_head()})": ROOT}
    if against is None:
        yield codes
        return
    with worktree_at(against) as worktree:
        yield {**codes, against: worktree}


def machine_line() -> str:
    """Date, CPU, core count and load: CPU timings mean little without them."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    cpu = platform.processor() or platform.machine()
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return f"{date}; {cpu}, {os.cpu_count()} cores, load average {load} (1/5/15 min)"


def hybridkv_env() -> dict[str, str]:
    """The environment for a subprocess that must run this checkout's hybridkv.

    The dev venv has hybridkv installed in editable mode from the main checkout, so a
    worktree's code is only used when the worktree is first on PYTHONPATH.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def peer_env() -> dict[str, str]:
    """The environment for a peer's interpreter: nothing of this checkout on its path."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def run_logged(
    cmd: Sequence[str | Path],
    log: Path,
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
) -> str:
    """Run ``cmd``; its stderr goes to ``log``, its stdout is returned.

    Raises:
        RuntimeError: it failed or timed out (the message names the log).
    """
    argv = [str(c) for c in cmd]
    with open(log, "w") as err:
        try:
            done = subprocess.run(
                argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env, timeout=timeout_s
            )
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(
                f"timed out after {timeout_s:g} s: {' '.join(argv)} (log {log})"
            ) from e
    if done.returncode != 0:
        raise RuntimeError(f"exit {done.returncode}: {' '.join(argv)} (log {log})")
    return done.stdout


def json_line(stdout: str, prefix: str) -> dict[str, Any]:
    """The one JSON line of ``stdout`` that starts with ``prefix`` (peers log to stdout too)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(prefix):
            return json.loads(line)
    raise RuntimeError(f"no line starting with {prefix!r} in the output")


def mark(met: bool) -> str:
    return "met" if met else "MISSED"


def median_range(values: Sequence[float], fmt: str) -> str:
    """'median (min-max)' of ``values`` with ``fmt``, e.g. '{:.2f}'."""
    if not values:
        return "-"
    med = fmt.format(statistics.median(values))
    if len(values) == 1:
        return med
    return f"{med} ({fmt.format(min(values))}-{fmt.format(max(values))})"

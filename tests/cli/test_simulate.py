"""``hybridkv simulate``: JSON output, one-line errors, and no torch anywhere in the simulator."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridkv.cli import main
from hybridkv.sim.traces import save_trace
from hybridkv.sim.workloads import ChatWorkload, chat_trace

KEYS = {
    "name",
    "token_hit_rate",
    "hit_tokens",
    "prompt_tokens",
    "ttft_mean_s",
    "ttft_p95_s",
    "throughput_tok_s",
    "preemptions",
    "snapshots_taken",
    "snapshots_kept",
}
NAMES = [
    "hybridkv",
    "hybridkv-prompt-end",
    "hybridkv-cost",
    "unified-page",
    "unified-page-retention",
    "static-split",
]


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "chat.json"
    save_trace(chat_trace(ChatWorkload(num_conversations=3, turns=2, seed=2)), path)
    return path


def test_json_has_every_design_and_key(
    trace_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["simulate", "--model", "qwen3.5-27b", "--memory-gib", "4", "--trace", str(trace_file)]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [d["name"] for d in out["designs"]] == NAMES
    for design in out["designs"]:
        assert set(design) >= KEYS


def test_num_kv_bytes_and_design_subset(
    trace_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["simulate", "--model", "qwen3.5-27b", "--num-kv-bytes", str(4 << 30)]
    argv += ["--trace", str(trace_file), "--designs", "static-split,hybridkv", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert [d["name"] for d in out["designs"]] == ["static-split", "hybridkv"]


def test_human_output_and_sweep_plot(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot = tmp_path / "sweep.png"
    argv = ["simulate", "--model", "qwen3.5-27b", "--memory-gib", "2", "--trace", str(trace_file)]
    argv += ["--designs", "hybridkv", "unified-page", "--sweep", "--plot", str(plot)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "token hit rate" in out and "unified-page" in out
    assert plot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--model", "no-such-model", "--memory-gib", "4"], "unknown model"),
        (["--model", "qwen3.5-27b", "--memory-gib", "-1"], "must be positive"),
        (["--model", "qwen3.5-27b"], "exactly one of --memory-gib"),
        (["--model", "qwen3.5-27b", "--memory-gib", "4", "--trace", "nope"], "unknown trace"),
        (["--model", "qwen3.5-27b", "--memory-gib", "4", "--designs", "x"], "unknown design"),
        (["--model", "qwen3.5-27b", "--memory-gib", "4", "--gpu", "TPU"], "unknown GPU"),
        (["--model", "qwen3.5-27b", "--num-kv-bytes", "1000"], "smaller than one chunk"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err and err.startswith("hybridkv simulate: error:")


def test_bad_trace_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"requests": [{"id": "a", "prompt_token_ids": []}]}))
    argv = ["simulate", "--model", "qwen3.5-27b", "--memory-gib", "4", "--trace", str(bad)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "prompt_token_ids" in err


def test_simulator_does_not_import_torch() -> None:
    code = "import sys, hybridkv.sim, hybridkv.cli.simulate; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_simulator_is_mypy_strict_clean(tmp_path: Path) -> None:
    """The simulator and its command are strict-clean. Modules they merely import (the parent
    package ``hybridkv.cli`` names every command, torch ones included) are read for their types
    but not judged (``--follow-imports=silent``), and a fresh cache makes the verdict the same
    on every machine: a stale ``.mypy_cache`` once hid such errors here and not in CI."""
    pytest.importorskip("mypy")
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent"]
    cmd += ["--cache-dir", str(tmp_path / "mypy"), "hybridkv/sim", "hybridkv/cli/simulate.py"]
    result = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr

"""``hybridkv plan``: the JSON report and one-line errors (run as the user runs it)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hybridkv.core.model_config import load_config_dict

GIB = 1 << 30


def run_plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hybridkv", "plan", *args],
        capture_output=True,
        text=True,
        check=False,
    )


def plan_json(*args: str) -> dict[str, Any]:
    result = run_plan(*args, "--json")
    assert result.returncode == 0, result.stderr
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def test_json_report_keys_and_physical_limit() -> None:
    data = plan_json("qwen3.5-0.8b", "--memory-gib", "8", "--max-model-len", "32768")
    for key in (
        "kv_bytes_per_token",
        "state_bytes_per_seq",
        "max_num_seqs",
        "kv_capacity_tokens",
        "physical_limit_tokens",
        "max_concurrency",
        "padding_waste_bytes",
        "chunk_bytes",
        "groups",
        "unified_page_baseline",
    ):
        assert key in data, key
    for group in data["groups"]:
        assert {"kind", "num_layers", "page_bytes", "block_tokens"} <= group.keys()
    assert [g["kind"] for g in data["groups"]] == ["attention", "gdn"]
    assert [g["num_layers"] for g in data["groups"]] == [6, 18]
    assert {"block_tokens", "kv_capacity_tokens", "max_concurrency"} <= data[
        "unified_page_baseline"
    ].keys()
    a, s, seqs = data["kv_bytes_per_token"], data["state_bytes_per_seq"], data["max_num_seqs"]
    assert data["physical_limit_tokens"] == (8 * GIB - seqs * s) // a
    assert data["physical_limit_tokens"] >= data["kv_capacity_tokens"]
    assert data["kv_capacity_tokens"] >= 0.99 * data["physical_limit_tokens"]


def test_ssm_fp32_doubles_the_state_of_qwen35_08b() -> None:
    base = plan_json("qwen3.5-0.8b", "--memory-gib", "8")
    fp32 = plan_json("qwen3.5-0.8b", "--memory-gib", "8", "--ssm-dtype", "float32")
    _, raw = load_config_dict("qwen3.5-0.8b")
    assert fp32["state_bytes_per_seq"] == raw["_computed"]["state_bytes_per_request_ssm_fp32"]
    assert (
        base["state_bytes_per_seq"] < fp32["state_bytes_per_seq"] < 2 * base["state_bytes_per_seq"]
    )  # the SSM part doubles, the conv part stays bf16
    conv = 18 * raw["_computed"]["recurrent_conv_elems_per_layer"] * 2
    assert fp32["state_bytes_per_seq"] - conv == 2 * (base["state_bytes_per_seq"] - conv)


def test_model_dir_path_works(tmp_path: Path) -> None:
    _, raw = load_config_dict("qwen3.5-0.8b")
    model_dir = tmp_path / "Qwen3.5-0.8B"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(raw))
    by_dir = plan_json(str(model_dir), "--memory-gib", "8")
    by_name = plan_json("qwen3.5-0.8b", "--memory-gib", "8")
    assert by_dir["model"] == "Qwen3.5-0.8B"
    assert {k: v for k, v in by_dir.items() if k != "model"} == {
        k: v for k, v in by_name.items() if k != "model"
    }


def test_text_report_prints() -> None:
    result = run_plan("qwen3.5-0.8b", "--memory-gib", "8")
    assert result.returncode == 0, result.stderr
    assert "physical limit" in result.stdout


def test_list_names_builtin_models() -> None:
    result = run_plan("--list")
    assert result.returncode == 0
    assert "qwen3.5-0.8b" in result.stdout.split()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["no-such-model", "--memory-gib", "8"], "unknown model"),
        (["{not_a_model}", "--memory-gib", "8"], "no model_type"),
        (["qwen3.5-0.8b", "--memory-gib", "-1"], "must be positive"),
        (["qwen3.5-0.8b", "--memory-gib", "inf"], "must be positive and finite"),
        (["qwen3.5-0.8b", "--memory-gib", "0.001"], "too small"),
        (["qwen3.5-0.8b", "--memory-gib", "1", "--max-model-len", "100000000"], "too small"),
        (["qwen3.5-0.8b", "--memory-gib", "8", "--ssm-dtype", "int3"], "unknown dtype"),
        (["qwen3.5-0.8b"], "--memory-gib is required"),
    ],
    ids=["unknown", "not-a-model", "negative", "inf", "tiny", "too-long", "dtype", "no-memory"],
)
def test_bad_input_is_one_line_on_stderr(args: list[str], message: str, tmp_path: Path) -> None:
    not_a_model = tmp_path / "tokenizer_config.json"
    not_a_model.write_text(json.dumps({"bos_token": "<s>"}))
    args = [str(not_a_model) if a == "{not_a_model}" else a for a in args]
    result = run_plan(*args)
    assert result.returncode != 0
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert message in lines[0]


@pytest.mark.skipif(shutil.which("hybridkv") is None, reason="console script not installed")
def test_console_script() -> None:
    result = subprocess.run(
        ["hybridkv", "plan", "lfm2-350m", "--memory-gib", "2", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["model"] == "lfm2-350m"


def test_closed_pipe_ends_quietly() -> None:
    """Regression: `hybridkv plan --list | head -1` ended in a BrokenPipeError traceback."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "hybridkv", "plan", "--list"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.close()  # the reader is gone before the command writes
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (0, b"")

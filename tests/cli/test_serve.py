"""``hybridkv serve`` as a user runs it: a subprocess, the openai client, Ctrl-C to stop."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI

from hybridkv.cli import main
from tests.serve_process import START_TIMEOUT_S, free_port, wait_until_serving


@pytest.mark.slow
def test_serve_command_chats_and_stops_cleanly(checkpoint: Path) -> None:
    port = free_port()
    command = [
        sys.executable, "-m", "hybridkv", "serve", "--model", str(checkpoint),
        "--port", str(port), "--served-model-name", "cli-model", "--api-key", "k",
        "--cache-memory-gib", "0.05", "--max-model-len", "128", "--log-level", "warning",
    ]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_serving(proc, port, timeout_s=START_TIMEOUT_S)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["cli-model"]
        reply = client.chat.completions.create(
            model="cli-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.choices[0].finish_reason in ("stop", "length")
    finally:
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert f"at http://127.0.0.1:{port}/v1 (API key required)" in stderr
    assert "Traceback" not in stderr


def test_serve_bad_model_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridkv serve: error: --model")
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("flag", "value", "words"),
    [
        ("--port", "70000", "--port must be in"),
        ("--max-body-mib", "0", "--max-body-mib"),
        ("--tool-call-parser", "nope", "unknown tool call parser"),
    ],
)
def test_serve_bad_flags(
    checkpoint: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, words: str
) -> None:
    assert main(["serve", "--model", str(checkpoint), flag, value]) == 2
    assert words in capsys.readouterr().err

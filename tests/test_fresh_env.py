"""The README's first command alone makes an environment in which the documented commands run.

One new virtual environment per session (a temporary directory, no system site-packages, no
test extras) is installed with the install half of the README's first Quick start command,
exactly as written, from the repository root. Then every ``hybridkv ...`` example of the
README and docs/*.md runs in it through the environment's own console script, with its
placeholders (``DIR``, ``path/to/checkpoint``, ...) filled in with a tiny local checkpoint and
trace. An example too slow for the suite runs in a smaller variant, written next to it below
with the reason; a new example in the docs fails ``test_every_documented_example_is_listed``
until it is listed here.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.install_helpers import (
    IMPORT_EVERY_MODULE,
    ROOT,
    documented_cli_commands,
    module_names_of_files,
    quick_start_commands,
)
from tests.serve_process import START_TIMEOUT_S, free_port, wait_until_serving

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class Example(NamedTuple):
    run: str | None  # what runs in the fresh environment (placeholders filled); None: not run
    why: str = ""  # why ``run`` differs from the documented command, or why it is not run


AS_WRITTEN = Example("")  # run exactly as documented, placeholders filled in
SMALLER_TRACE = "as written it takes minutes (the 16 GiB sweep: 8.4 min on the shared machine)"
# documented command -> how it runs here
EXAMPLES: dict[str, Example] = {
    "hybridkv plan MODEL --memory-gib X [--max-num-seqs S] [--max-model-len L] [--block-size B]":
        Example(None, "the synopsis of the command, not an example"),
    "hybridkv plan qwen3.5-0.8b --memory-gib 8 --max-model-len 32768": AS_WRITTEN,
    "hybridkv plan --list": AS_WRITTEN,
    'hybridkv generate --model DIR "prompt"': AS_WRITTEN,
    "hybridkv bench --model DIR --workload chat": Example(
        "hybridkv bench --model DIR --workload chat --num-requests 4",
        "32 requests as written: 37 s on the shared machine, 19 s with 4",
    ),
    "hybridkv serve": Example(
        None, "binds port 8000; the example below serves on a free port (same server)"
    ),
    "hybridkv serve path/to/checkpoint --port 8000 --served-model-name my-model "
    "--max-model-len 32k --gpu-memory-utilization 0.5 --enable-prefix-caching "
    "--generation-config auto --chat-template tmpl.jinja --kv-cache-dtype auto "
    "--trust-remote-code --uvicorn-log-level info --disable-log-requests [--api-key KEY] "
    "[--host 127.0.0.1] [--tensor-parallel-size 1] [--max-num-batched-tokens N]": Example(
        "hybridkv serve path/to/checkpoint --port PORT --served-model-name my-model "
        "--max-model-len 256 --cache-memory-gib 0.05 --enable-prefix-caching "
        "--generation-config auto --kv-cache-dtype auto --trust-remote-code "
        "--uvicorn-log-level info --disable-log-requests --api-key KEY --host 127.0.0.1 "
        "--tensor-parallel-size 1 --max-num-batched-tokens 256",
        "the optional flags given; a free port instead of 8000; a 0.05 GiB cache and 256 "
        "tokens for the tiny checkpoint (half the RAM and 32k would only take memory); "
        "its own chat template (no tmpl.jinja here)",
    ),
    "hybridkv serve --help": AS_WRITTEN,
    "hybridkv simulate --model qwen3.5-27b --memory-gib 16 --trace chat": AS_WRITTEN,
    "hybridkv simulate --model qwen3.5-27b --num-kv-bytes 17179869184 --json": AS_WRITTEN,
    "hybridkv simulate --model qwen3.5-27b --memory-gib 16 --sweep --plot s.png": Example(
        "hybridkv simulate --model qwen3.5-27b --memory-gib 16 --sweep --plot s.png --scale 0.05",
        SMALLER_TRACE,
    ),
    "hybridkv simulate --model path/to/config.json --memory-gib 8 --trace my.json "
    "--designs hybridkv static-split": AS_WRITTEN,
    "hybridkv simulate --model qwen3.5-27b --trace chat --memory-gib 16 --sweep --json": Example(
        "hybridkv simulate --model qwen3.5-27b --trace chat --memory-gib 16 --sweep --json "
        "--scale 0.05",
        SMALLER_TRACE,
    ),
    "hybridkv simulate --model qwen3.5-27b --trace agentic --memory-gib 16 --sweep --json":
        Example(
            "hybridkv simulate --model qwen3.5-27b --trace agentic --memory-gib 16 --sweep "
            "--json --scale 0.1",
            SMALLER_TRACE,
        ),
    "hybridkv simulate --model qwen3.5-27b --trace system-prompt --memory-gib 16 --sweep "
    "--json": Example(
        "hybridkv simulate --model qwen3.5-27b --trace system-prompt --memory-gib 16 --sweep "
        "--json --scale 0.1",
        SMALLER_TRACE,
    ),
    "hybridkv simulate --model qwen3.5-27b --trace system-prompt --memory-gib 16 --json":
        AS_WRITTEN,
    "hybridkv simulate --model qwen3.5-27b --trace system-prompt --memory-gib 16 --designs "
    "hybridkv hybridkv-prompt-end unified-page --json": AS_WRITTEN,
    "hybridkv simulate --model qwen3.5-27b --trace agentic --memory-gib 4 --designs hybridkv "
    "hybridkv-prompt-end --json": Example(
        "hybridkv simulate --model qwen3.5-27b --trace agentic --memory-gib 4 --designs hybridkv "
        "hybridkv-prompt-end --json --scale 0.1",
        "as written it takes 34 s on an idle 2-core machine",
    ),
    "hybridkv simulate --model qwen3.5-27b --trace chat --memory-gib 16 --designs hybridkv "
    "unified-page unified-page-retention --json": AS_WRITTEN,
    "hybridkv simulate --model qwen3.5-27b --trace agentic --memory-gib 4 --designs hybridkv "
    "unified-page unified-page-retention --json": AS_WRITTEN,
}  # fmt: skip
SERVE_EXAMPLE = next(k for k, v in EXAMPLES.items() if v.run and v.run.startswith("hybridkv serve"))
RUN_HERE = [k for k, v in EXAMPLES.items() if v.run is not None and k != SERVE_EXAMPLE]


def test_every_documented_example_is_listed() -> None:
    """Each ``hybridkv ...`` example of the README and docs/ is run below or says why not."""
    assert set(EXAMPLES) == set(documented_cli_commands())
    for command, example in EXAMPLES.items():
        assert example.run == "" or example.why, f"{command}: say why it does not run as written"


# ---------------------------------------------------------------- the environment


@dataclass(frozen=True)
class FreshEnv:
    """A virtual environment made by the README's install command alone."""

    venv: Path
    env: dict[str, str]  # this process's variables minus PYTHONPATH (the checkout's code)
    paths: dict[str, str]  # placeholder of the docs -> file it stands for here

    def run(
        self, command: str, cwd: Path, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        """``command`` in bash with the environment activated, as a user types it."""
        script = f"source {shlex.quote(str(self.venv / 'bin' / 'activate'))} && {command}"
        return subprocess.run(
            ["bash", "-c", script], cwd=cwd, env=self.env, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip

    def fill(self, command: str) -> str:
        """``command`` with the docs' placeholders replaced by local files."""
        words = [self.paths.get(word, word) for word in shlex.split(command)]
        return shlex.join(words)


@pytest.fixture(scope="module")
def fresh_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FreshEnv]:
    from hybridkv.sim.traces import save_trace
    from hybridkv.sim.workloads import ChatWorkload, chat_trace
    from tests.models.tiny import make_hf_model, save_checkpoint

    root = tmp_path_factory.mktemp("fresh-env")
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    model = save_checkpoint(make_hf_model("qwen3_5_text"), root / "tiny-checkpoint")
    trace = root / "my.json"
    save_trace(chat_trace(ChatWorkload(num_conversations=3, turns=2, seed=2)), trace)
    paths = {"DIR": str(model), "path/to/checkpoint": str(model), "my.json": str(trace)}
    paths["path/to/config.json"] = str(model / "config.json")
    fresh = FreshEnv(root / "venv", env, paths)
    install = quick_start_commands()[0].split(" && ")[0]
    result = fresh.run(install, cwd=ROOT, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    yield fresh
    shutil.rmtree(fresh.venv)  # about 1 GiB: pytest keeps the last three runs' tmp dirs


# ---------------------------------------------------------------- the commands


@pytest.mark.slow
def test_install_has_runtime_dependencies_only_and_every_module_imports(
    fresh_env: FreshEnv, tmp_path: Path
) -> None:
    probe = "import importlib.util, sys; print(sys.prefix); "
    probe += "print([m for m in ('pytest', 'transformers') if importlib.util.find_spec(m)])"
    result = fresh_env.run(f"python -c {shlex.quote(probe)}", cwd=tmp_path)
    assert result.stdout.split("\n")[:2] == [str(fresh_env.venv), "[]"], result.stderr
    result = fresh_env.run(f"python -c {shlex.quote(IMPORT_EVERY_MODULE)}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert not report["failed"], "\n".join(f"{k}:\n{v}" for k, v in report["failed"].items())
    assert set(report["modules"]) == module_names_of_files() - {"hybridkv", "hybridkv.__main__"}


@pytest.mark.slow
@pytest.mark.parametrize("documented", RUN_HERE, ids=lambda c: c.removeprefix("hybridkv "))
def test_documented_example_runs(fresh_env: FreshEnv, tmp_path: Path, documented: str) -> None:
    command = fresh_env.fill(EXAMPLES[documented].run or documented)
    result = fresh_env.run(command, cwd=tmp_path)
    assert result.returncode == 0, f"{command}\n{result.stderr}"
    assert "Traceback" not in result.stderr and result.stdout.strip(), result.stderr
    words = shlex.split(command)
    if "--json" in words:
        json.loads(result.stdout)
    if "--plot" in words:
        assert (tmp_path / words[words.index("--plot") + 1]).read_bytes()[:8] == PNG_SIGNATURE
    if words[1] == "generate":
        check_generate(words, result.stdout)
    if words[1] == "plan":
        check_plan(words, result.stdout)


def check_generate(words: list[str], out: str) -> None:
    """The fresh environment's completion is the checkout's engine's, token for token."""
    from hybridkv import LLM

    llm = LLM(words[words.index("--model") + 1], cache_memory_gib=0.1)
    # generate samples as the server does: the generation config's defaults, else vLLM's
    params = llm.engine.default_sampling_params(max_tokens=64)
    (expected,) = llm.generate(words[-1], params)
    assert out == expected.outputs[0].text + "\n"


def check_plan(words: list[str], out: str) -> None:
    """``plan --list`` lists as many models as the README says; the README's worked example
    prints the figures the README quotes."""
    readme = (ROOT / "README.md").read_text()
    if "--list" in words:
        (count,) = re.findall(r"the (\d+) configs", readme)
        assert len(out.split()) == int(count)
        return
    example = readme.split(" ".join(words), 1)[1][:1000]
    (kv_tokens,) = re.findall(r"([\d,]+) KV tokens", example)
    (limit,) = re.findall(r"physical limit ([\d,]+)", example)
    (chunk,) = re.findall(r"in ([\d.]+ MiB) chunks", example)
    for figure in (kv_tokens, limit, chunk):
        assert figure in out, (figure, out)


@pytest.mark.slow
def test_demo_chats_and_reports_prefix_cache_hits(fresh_env: FreshEnv, tmp_path: Path) -> None:
    """The README's main command as written: the demo model shipped in the package (no
    training), its capacity report, five turns with growing prefix-cache hits."""
    demo = quick_start_commands()[0].split(" && ")[1]
    assert demo == "hybridkv demo"
    result = fresh_env.run(demo, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "KV capacity (attention groups only)" in result.stdout, result.stdout
    assert [f"[turn {k}]" in result.stdout for k in range(1, 6)] == [True] * 5
    cached = [int(n) for n in re.findall(r"(\d+) from the prefix cache", result.stdout)]
    assert len(cached) == 5 and cached[0] == 0 and min(cached[1:]) > 0, result.stdout


@pytest.mark.slow
def test_serve_example_answers_the_openai_client(fresh_env: FreshEnv, tmp_path: Path) -> None:
    """The README's serve example, then its openai-client snippet against it."""
    from openai import OpenAI

    port = free_port()
    command = fresh_env.fill(str(EXAMPLES[SERVE_EXAMPLE].run).replace("PORT", str(port)))
    script = f"source {shlex.quote(str(fresh_env.venv / 'bin' / 'activate'))} && exec {command}"
    proc = subprocess.Popen(
        ["bash", "-c", script], cwd=tmp_path, env=fresh_env.env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        wait_until_serving(proc, port, timeout_s=START_TIMEOUT_S)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="KEY", max_retries=0)
        reply = client.chat.completions.create(
            model="my-model", messages=[{"role": "user", "content": "What color is the sky?"}],
            max_tokens=8,
        )  # fmt: skip
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage is not None and reply.usage.completion_tokens > 0
    finally:
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr

"""``hybridkv generate``, ``bench`` and ``demo`` on a tiny random checkpoint, called in-process.

Each command is run through ``hybridkv.cli.main`` as the console script runs it; stdout and
stderr are captured. User errors must be one line on stderr and exit status 2.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hybridkv.cli import main
from hybridkv.cli.generate import stop_prefix_chars
from hybridkv.ops import ahead_of_time
from hybridkv.ops.compiled import compile_enabled

SMALL_CACHE = ["--cache-memory-gib", "0.1"]


@pytest.fixture(scope="module")
def model_dir(checkpoint: Path) -> str:
    return str(checkpoint)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny matmuls: threads only add synchronisation, and a busy machine makes it far worse."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    """Exit 2 and one error line (INFO log lines of the start-up before it aside)."""
    assert code == 2
    lines = [line for line in err.strip().splitlines() if not line.startswith("INFO ")]
    assert len(lines) == 1, err
    assert lines[0].startswith("hybridkv ") and ": error: " in lines[0]
    for needle in needles:
        assert needle in lines[0]


def test_generate_streams_the_engines_greedy_text(
    model_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from hybridkv import LLM, SamplingParams

    code, out, err = run(
        capsys,
        *("generate", "--model", model_dir, *SMALL_CACHE),
        *("--max-tokens", "12", "--temperature", "0", "Hello"),
    )
    assert code == 0, err
    llm = LLM(model_dir, cache_memory_gib=0.1)
    (expected,) = llm.generate("Hello", SamplingParams(max_tokens=12, temperature=0.0))
    assert expected.outputs[0].text
    assert out == expected.outputs[0].text + "\n"
    assert "12 tokens" in err


def test_generate_several_prompts_in_order_with_chat(
    model_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(
        capsys,
        *("generate", "--model", model_dir, *SMALL_CACHE, "--max-tokens", "6", "--chat"),
        *("--system", "Be brief.", "--temperature", "0.8", "--top-p", "0.9", "--seed", "3"),
        "first question",
        "second question",
    )
    assert code == 0, err
    first, second = out.index("── prompt 1: first question"), out.index("── prompt 2: second")
    assert first < second
    assert "2 prompts: 12 tokens" in err


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--max-tokens", "0"], "--max-tokens must be"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be a positive integer"),
        (["--checkpoint-interval", "10"], "multiple of the block size"),
        (["--max-model-len", "1000000000"], "does not fit in the cache"),
    ],
    ids=["max-tokens", "temperature", "top-p", "max-num-seqs", "interval", "max-model-len"],
)
def test_generate_bad_flags_are_one_line_errors(
    model_dir: str, capsys: pytest.CaptureFixture[str], flags: list[str], needle: str
) -> None:
    code, out, err = run(capsys, "generate", "--model", model_dir, *SMALL_CACHE, *flags, "hi")
    assert out == ""
    assert_one_line_error(code, err, needle)


def test_generate_missing_model_dir_and_empty_prompt(
    tmp_path: Path, model_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "generate", "--model", str(tmp_path / "nope"), "hi")
    assert_one_line_error(code, err, "no such directory")
    code, _, err = run(capsys, "generate", "--model", str(tmp_path), "hi")
    assert_one_line_error(code, err, "no config.json")
    code, _, err = run(capsys, "generate", "--model", model_dir, "")
    assert_one_line_error(code, err, "PROMPT is empty")


def test_generate_prompt_longer_than_max_model_len(
    model_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(
        capsys, "generate", "--model", model_dir, *SMALL_CACHE, "--max-model-len", "8", "x" * 20
    )
    assert out == ""
    assert_one_line_error(code, err, "max_model_len is 8")


def test_stop_string_prefixes_are_held_back() -> None:
    assert stop_prefix_chars("hello wor", ["world"]) == 3
    assert stop_prefix_chars("hello w", ["xyz", "wo"]) == 1
    assert stop_prefix_chars("hello", ["world"]) == 0
    assert stop_prefix_chars("", ["world"]) == 0


def test_bench_json_reports_throughput_ttft_and_hits(
    model_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(
        capsys,
        *("bench", "--model", model_dir, *SMALL_CACHE, "--workload", "chat"),
        *("--num-requests", "6", "--json"),
    )
    assert code == 0, err
    report = json.loads(out)
    for key in (
        "workload",
        "num_requests",
        "output_tokens_per_s",
        "total_tokens_per_s",
        "ttft_mean_s",
        "ttft_p95_s",
        "prefix_cache_hit_rate",
        "num_preemptions",
        "config",
    ):
        assert key in report, key
    assert report["num_requests"] == 6
    assert report["output_tokens_per_s"] > 0
    assert 0 < report["prefix_cache_hit_rate"] <= 1  # turns 2.. resume from turn 1's snapshot
    assert report["ttft_p95_s"] >= report["ttft_mean_s"] * 0.5


def test_bench_table_and_bad_request_count(
    model_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(
        capsys,
        *("bench", "--model", model_dir, *SMALL_CACHE, "--workload", "repeat"),
        *("--num-requests", "5", "--no-prefix-caching"),
    )
    assert code == 0, err
    assert "output tokens/s" in out and "preemptions" in out
    code, _, err = run(capsys, "bench", "--model", model_dir, "--num-requests", "0")
    assert_one_line_error(code, err, "--num-requests must be at least 1")


def test_demo_with_model_override_shows_growing_hits(
    model_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "demo", "--model", model_dir, *SMALL_CACHE, "--max-tokens", "8")
    assert code == 0, err
    stats = [line for line in out.splitlines() if "from the prefix cache" in line]
    assert len(stats) == 5
    cached = [int(line.split(", ")[1].split()[0]) for line in stats]
    assert cached[0] == 0
    assert all(a < b for a, b in itertools.pairwise(cached))


def test_demo_without_compare_times_one_run_and_never_resets(
    model_dir: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--no-compare: no caching-off engine, so no repeats and no cache reset: one timing
    per turn, said to be one run. --repeats below 1 is a one-line error."""
    from hybridkv.engine import LLMEngine

    def no_reset(engine: LLMEngine) -> bool:
        raise AssertionError("--no-compare reset the prefix cache")

    monkeypatch.setattr(LLMEngine, "reset_prefix_cache", no_reset)
    argv = ["demo", "--model", model_dir, *SMALL_CACHE, "--max-tokens", "4", "--no-compare"]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    timings = [line for line in out.splitlines() if "first token after" in line]
    assert len(timings) == 5 and all(line.endswith("ms (one run)") for line in timings)
    code, _, err = run(capsys, "demo", "--model", model_dir, *SMALL_CACHE, "--repeats", "0")
    assert_one_line_error(code, err, "--repeats must be >= 1, not 0")


def test_no_model_uses_the_shipped_demo_model(capsys: pytest.CaptureFixture[str]) -> None:
    from hybridkv.demo import SHIPPED_DIR

    code, out, err = run(capsys, "generate", *SMALL_CACHE, "--max-tokens", "4", "hi")
    assert code == 0, err
    assert out.strip()
    assert f"using the demo model shipped in {SHIPPED_DIR}" in err


def test_bench_profile_prints_modules_stages_and_ops(
    model_dir: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trace = tmp_path / "trace.json"
    code, out, err = run(
        capsys,
        *("bench", "--model", model_dir, *SMALL_CACHE, "--workload", "repeat"),
        *("--num-requests", "3", "--profile", "--profile-rows", "40"),
        *("--profile-trace", str(trace)),
    )
    assert code == 0, err
    profile = out[out.index("profile: ") :]
    steps = int(profile.split()[1])
    assert steps > 0
    assert "by module and engine stage" in profile and "by op (self CPU)" in profile
    # the tiny Qwen3.5's steps run its decode and prefill graphs where packages are on (a
    # graph runs no module), its eager modules elsewhere
    graphs = ahead_of_time.available() and compile_enabled()
    model_time = ("stage: runner.prefill_graph",) if graphs else ("module: PagedAttention",)
    for name in ("stage: engine.step", "stage: runner.build_batch", *model_time):
        assert name in profile, name
    assert "aten::" in profile
    assert json.loads(trace.read_text())["traceEvents"]
    code, _, err = run(capsys, "bench", "--model", model_dir, "--profile-trace", str(trace))
    assert_one_line_error(code, err, "--profile-trace needs --profile")

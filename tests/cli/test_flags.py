"""vLLM command lines: every flag parses and reaches EngineConfig / ServerConfig.

The flags are generated from the config dataclasses, so these tests parse real command
lines with the real parser and build the configs from them, without loading a model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from hybridkv.cli import build_parser, main
from hybridkv.cli.config_args import flag_name
from hybridkv.cli.engine_args import engine_config_from_args, model_arg
from hybridkv.cli.serve import server_config_from_args
from hybridkv.engine.config import EngineConfig, human_readable_int
from hybridkv.server.config import ServerConfig

MODEL = "/models/qwen"

# (argv after ``serve MODEL``, config field, expected value): vLLM's names first.
ENGINE_FLAGS: list[tuple[list[str], str, Any]] = [
    (["--max-model-len", "32k"], "max_model_len", 32_000),
    (["--max-model-len", "32K"], "max_model_len", 32_768),
    (["--max-model-len", "auto"], "max_model_len", None),
    (["--max-model-len", "-1"], "max_model_len", None),
    (["--max-num-seqs", "128"], "max_num_seqs", 128),
    (["--max-num-batched-tokens", "8k"], "max_num_batched_tokens", 8_000),
    (["--gpu-memory-utilization", "0.5"], "gpu_memory_utilization", 0.5),
    (["--cache-memory-gib", "3.5"], "cache_memory_gib", 3.5),
    (["--block-size", "32"], "block_size", 32),
    (["--enable-prefix-caching"], "enable_prefix_caching", True),
    (["--no-enable-prefix-caching"], "enable_prefix_caching", False),
    (["--no-prefix-caching"], "enable_prefix_caching", False),
    (["--mamba-cache-mode", "align"], "mamba_cache_mode", "align"),
    (["--dtype", "bfloat16"], "dtype", "bfloat16"),
    (["--dtype", "half"], "dtype", "float16"),
    (["--dtype", "float"], "dtype", "float32"),
    (["--kv-cache-dtype", "fp8"], "kv_cache_dtype", "fp8"),
    (["--kv-cache-dtype", "bfloat16"], "kv_cache_dtype", "bfloat16"),
    (["--mamba-ssm-cache-dtype", "float32"], "mamba_ssm_cache_dtype", "float32"),
    (["--tensor-parallel-size", "1"], "tensor_parallel_size", 1),
    (["-tp", "1"], "tensor_parallel_size", 1),
    (["--generation-config", "vllm"], "generation_config", "vllm"),
    (["--generation-config", "/some/dir"], "generation_config", "/some/dir"),
    (
        ["--override-generation-config", '{"temperature": 0.5}'],
        "override_generation_config",
        {"temperature": 0.5},
    ),
    (["--chat-template", "template.jinja"], "chat_template", "template.jinja"),
    (["--tokenizer", "/tok"], "tokenizer", "/tok"),
    (["--trust-remote-code"], "trust_remote_code", True),
    (["--seed", "7"], "seed", 7),
    (["--device", "cpu"], "device", "cpu"),
    ([], "pack_weights", None),  # auto: hybridkv.models.loader.packs_by_default
    (["--pack-weights"], "pack_weights", True),
    (["--no-pack-weights"], "pack_weights", False),
    (["--eviction", "cost"], "eviction", "cost"),
    (["--checkpoint-interval", "64"], "checkpoint_interval", 64),
    (["--enforce-eager"], "enforce_eager", True),
    (["--decode-burst-budget-ms", "10"], "decode_burst_budget_ms", 10.0),
    (["--decode-burst-budget-ms", "none"], "decode_burst_budget_ms", None),
]
SERVER_FLAGS: list[tuple[list[str], str, Any]] = [
    (["--uvicorn-log-level", "debug"], "uvicorn_log_level", "debug"),
    (["--log-level", "warning"], "uvicorn_log_level", "warning"),
    (["--disable-log-requests"], "disable_log_requests", True),
    (["--enable-log-requests"], "enable_log_requests", True),
    (["--served-model-name", "qwen"], "served_model_name", "qwen"),
    (["--api-key", "k"], "api_key", "k"),
    (["--host", "0.0.0.0"], "host", "0.0.0.0"),
    (["--port", "9000"], "port", 9000),
    (["--disable-fastapi-docs"], "disable_fastapi_docs", True),
    (["--timeout-keep-alive", "2"], "timeout_keep_alive", 2.0),
    (["--timeout-request-header", "3"], "timeout_request_header", 3.0),
    (["--timeout-request-body", "4"], "timeout_request_body", 4.0),
    (["--max-connections", "10"], "max_connections", 10),
    (["--shutdown-timeout", "5"], "shutdown_timeout", 5.0),
]


def parse(*argv: str) -> Any:
    return build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize(("argv", "name", "value"), ENGINE_FLAGS, ids=lambda x: str(x))
def test_vllm_engine_flag_reaches_the_config(argv: list[str], name: str, value: Any) -> None:
    config = engine_config_from_args(parse(MODEL, *argv), model=MODEL)
    assert getattr(config, name) == value
    others = {f.name for f in dataclasses.fields(EngineConfig)} - {name, "model"}
    for other in others:  # nothing else moved off its default
        field = EngineConfig.__dataclass_fields__[other]
        if name == "dtype" and other == "dtype":
            continue
        assert getattr(config, other) == field.default, other


@pytest.mark.parametrize(("argv", "name", "value"), SERVER_FLAGS, ids=lambda x: str(x))
def test_vllm_server_flag_reaches_the_config(
    argv: list[str], name: str, value: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    for env in ("HYBRIDKV_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(env, raising=False)
    assert getattr(server_config_from_args(parse(MODEL, *argv)), name) == value


def test_every_config_field_has_a_generated_flag() -> None:
    """A field added to EngineConfig or ServerConfig gets its flag without CLI changes."""
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    options = {s for action in serve._actions for s in action.option_strings}
    for cls in (EngineConfig, ServerConfig):
        for field in dataclasses.fields(cls):
            if field.name != "model" and field.metadata.get("cli", True):
                assert flag_name(field.name) in options, field.name
    help_text = serve.format_help()
    assert "fraction of the device's memory" in help_text  # the docstring is the help


def test_model_is_positional_as_in_vllm_serve_and_model_flag_works_too() -> None:
    assert model_arg(parse(MODEL)) == MODEL
    assert model_arg(parse("--model", MODEL)) == MODEL
    assert model_arg(parse()) is None  # the demo model
    with pytest.raises(ValueError, match="disagree"):
        model_arg(parse(MODEL, "--model", "/other"))


def test_api_key_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYBRIDKV_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert server_config_from_args(parse(MODEL)).api_key == "from-env"
    assert server_config_from_args(parse(MODEL, "--api-key", "flag")).api_key == "flag"


@pytest.mark.parametrize(
    "argv",
    [
        ["--distributed-executor-backend", "mp"],
        ["--swap-space", "4"],
        ["--pipeline-parallel-size", "2"],
    ],
    ids=lambda a: a[0],
)
def test_unknown_vllm_flag_is_one_line_naming_it(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", MODEL, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hybridkv serve: error: unrecognized")
    assert argv[0] in err[0]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--tensor-parallel-size", "2"], "--tensor-parallel-size must be 1"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
        (
            ["--gpu-memory-utilization", "0.5", "--cache-memory-gib", "1"],
            "not both",
        ),
        (["--max-model-len", "1.5K"], "no decimals with a binary suffix"),
        (["--override-generation-config", "[1]"], "must be a JSON object"),
        (["--kv-cache-dtype", "int4"], "invalid choice"),
        (["--no-enable-prefix-caching", "--mamba-cache-mode", "align"], "needs"),
        (["--decode-burst-budget-ms", "0"], "--decode-burst-budget-ms must be positive"),
        (["--decode-burst-budget-ms", "soon"], "--decode-burst-budget-ms"),
    ],
    ids=lambda x: str(x),
)
def test_bad_values_are_one_line_errors_naming_the_flag(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert main(["serve", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_human_readable_int_follows_vllm() -> None:
    assert [human_readable_int(t) for t in ("1k", "1K", "25.6k", "2M", "7")] == [
        1_000,
        1_024,
        25_600,
        2 * 1024**2,
        7,
    ]

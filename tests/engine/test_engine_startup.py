"""Start-up as a vLLM user meets it: the capacity report (== ``hybridkv plan``), the cache
size from gpu_memory_utilization, a lowered max_model_len that says why, generation_config
defaults, vLLM's options accepted, and ``LLM`` used from two threads at once."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_checkpoints import ARCH, ARCHITECTURES, OPTIONS

from hybridkv import LLM, SamplingParams
from hybridkv.cli import main
from hybridkv.core.units import GIB
from hybridkv.engine import EngineConfig, llm_engine, startup
from hybridkv.engine.spec_decode import setup
from hybridkv.layers.fp32_matmul import Fp32Linear, upcast_extra_bytes
from hybridkv.models import loader
from hybridkv.ops import ahead_of_time

PROMPTS = ["Hello there", "What is the capital", "Once upon a time", "one two three four"]


@pytest.fixture(scope="module")
def ckpt(checkpoints: Any) -> Path:
    return checkpoints(ARCH)[1]


def with_generation_config(src: Path, dst: Path, **fields: Any) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "generation_config.json").read_text())
    (dst / "generation_config.json").write_text(json.dumps(config | fields))
    return dst


# ---------------------------------------------------------------------- capacity report


def plan_json(command: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    argv = shlex.split(command)
    assert argv[:2] == ["hybridkv", "plan"]
    capsys.readouterr()
    assert main([*argv[1:], "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "options",
    [
        {"cache_memory_gib": 0.02, "max_num_seqs": 8, "max_model_len": 512},
        {"cache_memory_gib": 0.003, "max_num_seqs": 64, "block_size": 32},
    ],
    ids=["kv-binds", "long-default"],
)
def test_startup_report_equals_hybridkv_plan(
    ckpt: Path, options: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    llm = LLM(str(ckpt), **options)
    stats = llm.stats()
    command = next(line for line in llm.capacity_report if "hybridkv plan" in line)
    expected = plan_json(command.split(": ", 1)[1], capsys)
    assert stats["capacity"] == expected | {"model": stats["capacity"]["model"]}
    assert stats["capacity_report"] == llm.capacity_report
    concurrency = stats["capacity"]["concurrency"]
    assert concurrency["effective"] == min(concurrency["joint"], options["max_num_seqs"])
    line = next(line for line in llm.capacity_report if "max concurrency" in line)
    assert f": {concurrency['effective']:,} sequence" in line
    assert f"KV-bound {concurrency['kv_bound']:,}" in line
    assert "unified page size" in " ".join(llm.capacity_report)


def test_lowered_max_model_len_says_why_and_by_how_much(ckpt: Path) -> None:
    llm = LLM(str(ckpt), cache_memory_gib=0.001, max_num_seqs=4)
    native = json.loads((ckpt / "config.json").read_text())["max_position_embeddings"]
    fits = llm.engine.max_model_len
    assert fits < native
    note = llm.capacity_report[0]
    assert note.startswith(f"max_model_len lowered from the model's {native:,} to {fits:,}")
    assert f"{native - fits:,} fewer" in note and "cache_memory_gib 0.001" in note


def test_gpu_memory_utilization_is_a_fraction_of_available_memory(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(startup, "available_memory_bytes", lambda device: (GIB // 10, GIB))
    llm = LLM(str(ckpt), gpu_memory_utilization=0.25, max_num_seqs=4, max_model_len=256)
    assert llm.stats()["capacity"]["memory_bytes"] == int(0.25 * (GIB // 10))
    assert "(gpu_memory_utilization 0.25 of the 0.1 GiB of RAM available)" in llm.capacity_report[0]
    with pytest.raises(ValueError, match="not both"):
        LLM(str(ckpt), gpu_memory_utilization=0.25, cache_memory_gib=1.0)


# ---------------------------------------------------------------------- generation config


def test_generation_config_top_k_1_makes_unseeded_requests_identical(
    ckpt: Path, tmp_path: Path
) -> None:
    greedy_by_file = with_generation_config(ckpt, tmp_path / "topk1", top_k=1, max_new_tokens=6)
    llm = LLM(str(greedy_by_file), **OPTIONS)
    assert llm.get_default_sampling_params().top_k == 1
    outs = [llm.generate(PROMPTS[0], use_tqdm=False)[0].outputs[0].token_ids for _ in range(3)]
    assert outs[0] == outs[1] == outs[2] and len(outs[0]) == 6  # max_new_tokens applied
    greedy = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    assert outs[0] == greedy[0].outputs[0].token_ids


def test_generation_config_vllm_ignores_the_file_and_overrides_apply(
    ckpt: Path, tmp_path: Path
) -> None:
    path = with_generation_config(ckpt, tmp_path / "g", top_k=1, temperature=0.7, do_sample=True)
    ignored = LLM(str(path), generation_config="vllm", **OPTIONS)
    assert ignored.engine.generation_defaults == {}
    params = ignored.get_default_sampling_params()
    assert (params.top_k, params.temperature) == (0, 1.0)  # vLLM's defaults
    overridden = LLM(
        str(path), override_generation_config={"temperature": 0.3, "top_p": 0.9}, **OPTIONS
    )
    assert overridden.engine.generation_defaults == {"temperature": 0.3, "top_k": 1, "top_p": 0.9}
    elsewhere = LLM(str(ckpt), generation_config=str(path), **OPTIONS)
    assert elsewhere.engine.generation_defaults == {"temperature": 0.7, "top_k": 1}
    with pytest.raises(ValueError, match="no such file"):
        LLM(str(ckpt), generation_config=str(tmp_path / "missing"), **OPTIONS)


# ---------------------------------------------------------------------- vLLM's options


def test_vllm_options_are_accepted(
    ckpt: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    with caplog.at_level(logging.WARNING, logger="hybridkv"):
        llm = LLM(
            str(ckpt),
            trust_remote_code=True,
            tensor_parallel_size=1,
            chat_template=str(template),
            kv_cache_dtype="bfloat16",
            **OPTIONS,
        )
    assert "no code from the checkpoint ever runs" in caplog.text
    tokenizer = llm.get_tokenizer()
    assert tokenizer is not None
    assert tokenizer.render_chat([{"role": "user", "content": "hi"}]) == "[hi]"
    kv = startup.spec_dtypes(llm.engine.spec)[0]
    assert kv == "bfloat16"
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(TypeError, match="swap_space"):
        LLM(str(ckpt), swap_space=4)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_kv_cache_runs_and_halves_kv_bytes(ckpt: Path, kv_cache_dtype: str) -> None:
    fp32 = LLM(str(ckpt), **OPTIONS)
    fp8 = LLM(str(ckpt), kv_cache_dtype=kv_cache_dtype, **OPTIONS)
    assert fp8.engine.spec.kv_bytes_per_token * 4 == fp32.engine.spec.kv_bytes_per_token
    params = SamplingParams(max_tokens=8, temperature=0)
    out = fp8.generate(PROMPTS[2], params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8 and out.error is None


# ---------------------------------------------------------------------- threads


def test_two_threads_calling_generate_get_their_own_correct_outputs(ckpt: Path) -> None:
    llm = LLM(str(ckpt), **OPTIONS)
    params = SamplingParams(max_tokens=12, temperature=0)
    expected = {p: llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS}
    results: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def worker(index: int) -> None:
        try:
            barrier.wait()
            mine = PROMPTS[index::2]
            for _ in range(3):
                outs = llm.generate(mine, params, use_tqdm=False)
                results.setdefault(index, []).extend(o.outputs[0].token_ids for o in outs)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for index in range(2):
        mine = PROMPTS[index::2]
        assert results[index] == [expected[p] for p in mine] * 3
    assert not llm.engine.has_unfinished_requests()


def test_a_draft_models_layers_are_planned_with_the_cache_dtypes(
    checkpoints: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """A draft model's layers take the engine's kv_cache_dtype and mamba_ssm_cache_dtype
    (regression: they kept the draft checkpoint's defaults), and the printed
    ``hybridkv plan`` command (``--draft-model``) reports the same capacity as the engine,
    whose arena holds the draft's pages too (regression: the command left them out)."""
    _, target = checkpoints(ARCH)
    _, draft = checkpoints("nemotron_h")  # a Mamba2 hybrid: KV and SSM state
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    llm = LLM(
        str(target),
        speculative_config=spec,
        cache_memory_gib=0.02,
        max_num_seqs=8,
        max_model_len=256,
        kv_cache_dtype="fp8",
        mamba_ssm_cache_dtype="float16",
    )
    drafts = [layer for layer in llm.engine.speculative.cache_spec.layers if layer.draft]
    assert drafts
    dtypes = startup.spec_dtypes(
        dataclasses.replace(llm.engine.speculative.cache_spec, layers=tuple(drafts))
    )
    assert (dtypes[0], dtypes[2]) == ("float8_e4m3fn", "float16")
    stats = llm.stats()
    command = next(line for line in llm.capacity_report if "hybridkv plan" in line)
    assert f"--draft-model {draft}" in command
    expected = plan_json(command.split(": ", 1)[1], capsys)
    assert stats["capacity"] == expected | {"model": stats["capacity"]["model"]}
    without_draft = plan_json(command.split(": ", 1)[1].split(" --draft-model")[0], capsys)
    assert without_draft["state_bytes_per_seq"] != expected["state_bytes_per_seq"]


# dynamo and inductor: seconds to import on a slow machine (hybridkv.ops.compiled._failures)
COMPILER_MODULES = ("torch._dynamo", "torch._inductor")
SERVE_WITHOUT_COMPILER = """
import sys
from hybridkv import LLM, SamplingParams
import hybridkv.cli, hybridkv.server
loaded = [m for m in {modules!r} if m in sys.modules]
assert not loaded, f"imported with hybridkv: {{loaded}}"
for path in {paths!r}:
    llm = LLM(path, enforce_eager={eager!r}, max_model_len=128, cache_memory_gib=0.02)
    out = llm.generate(["Hello there"], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4
    loaded = [m for m in {modules!r} if m in sys.modules]
    print("LOADED", path, ",".join(loaded))
    print("TOKENS", path, list(out[0].outputs[0].token_ids))
"""
GDN_ARCHITECTURES = ("qwen3_5_moe_text", "qwen3_5_text", "qwen3_next")  # compiled decode step


@pytest.mark.parametrize(
    ("archs", "eager", "compiles"),
    [
        (tuple(a for a in ARCHITECTURES if a not in GDN_ARCHITECTURES), False, False),
        ((ARCH,), True, False),
        ((ARCH,), False, True),
    ],
    ids=["no-compiled-ops", "enforce-eager", "gdn-compiles"],
)
def test_the_compiler_is_imported_only_by_an_engine_that_compiles(
    checkpoints: Any, archs: tuple[str, ...], eager: bool, compiles: bool
) -> None:
    """Importing hybridkv (the engine, the CLI, the server) imports neither dynamo nor
    inductor, and an engine imports them only to compile: every family without compiled
    ops, each loaded and served in turn, or an ``enforce_eager`` engine serves without them
    (regressions: ``hybridkv.ops.compiled`` imported dynamo with the package, 1.7 s of
    every start-up on a slow machine; the loader's meta build and Zamba2's meta attention
    ran torch's Python references of ``normal_``, ``arange``..., which import it). One
    fresh interpreter a case: this one has imported them long ago."""
    assert set(GDN_ARCHITECTURES) <= set(ARCHITECTURES)
    paths = [str(checkpoints(arch)[1]) for arch in archs]
    lines = serve_in_a_fresh_interpreter(paths, eager, aot_cache="off")  # compiles just in time
    expected = ",".join(COMPILER_MODULES) if compiles else ""
    assert all(loaded == expected for loaded, _ in lines.values()), lines


def serve_in_a_fresh_interpreter(
    paths: list[str], eager: bool, aot_cache: str
) -> dict[str, tuple[str, str]]:
    """Each checkpoint loaded and served in turn in a new Python (SERVE_WITHOUT_COMPILER),
    packages compiled ahead of time in ``aot_cache`` ("off": none): path -> (the compiler
    modules imported by then, the reply's tokens)."""
    code = SERVE_WITHOUT_COMPILER.format(modules=COMPILER_MODULES, paths=paths, eager=eager)
    env = {**os.environ, ahead_of_time.CACHE_ENV: aot_cache}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found: dict[str, dict[str, str]] = {"LOADED": {}, "TOKENS": {}}
    for line in done.stdout.splitlines():
        kind, path, rest = [*line.split(" ", 2), "", ""][:3]
        if kind in found:
            found[kind][path] = rest
    assert list(found["LOADED"]) == paths and list(found["TOKENS"]) == paths
    return {path: (found["LOADED"][path], found["TOKENS"][path]) for path in paths}


def test_a_second_start_loads_the_compiled_step_without_the_compiler(checkpoints: Any) -> None:
    """The GDN decode step compiled ahead of time (hybridkv.ops.ahead_of_time), in the
    engine's own package cache: a first engine process loads its package, or builds it
    (importing the compiler) where the cache lacks it; the next one loads it and serves
    without importing dynamo or inductor, the same reply. The cache is the real one, so a
    warm machine's suite does not spend half a minute rebuilding it each run (the build
    itself: tests/ops/test_ahead_of_time.py on a cold cache)."""
    path = str(checkpoints(ARCH)[1])
    cache = ahead_of_time.cache_dir()
    if cache is None:
        pytest.skip(f"{ahead_of_time.CACHE_ENV} is off")
    before = set(cache.glob("gdn-mixer-decode-*.pt2"))
    first = serve_in_a_fresh_interpreter([path], eager=False, aot_cache=str(cache))
    built = set(cache.glob("gdn-mixer-decode-*.pt2")) - before
    assert first[path][0] == (",".join(COMPILER_MODULES) if built else "")
    assert len(built) <= 1 and not list(cache.glob(".*partial*"))
    second = serve_in_a_fresh_interpreter([path], eager=False, aot_cache=str(cache))
    assert second[path] == ("", first[path][1])


def test_the_weights_limit_leaves_room_for_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """weight_memory_limit (what "auto" fp32 matmul copies may grow the weights to): 90%
    of the RAM available at start less a fixed cache, half of it when the cache is sized
    from what the weights leave, no limit off the CPU."""
    monkeypatch.setattr(startup, "available_memory_bytes", lambda device: (10 * GIB, 16 * GIB))
    cpu = torch.device("cpu")
    fixed = startup.weight_memory_limit(EngineConfig(model="m", cache_memory_gib=2), cpu)
    assert fixed == int(0.9 * 10 * GIB) - 2 * GIB
    default = startup.weight_memory_limit(EngineConfig(model="m"), cpu)  # 2 GiB fixed
    assert default == fixed
    sized = startup.weight_memory_limit(EngineConfig(model="m", gpu_memory_utilization=0.8), cpu)
    assert sized == 5 * GIB
    assert startup.weight_memory_limit(EngineConfig(model="m"), torch.device("meta")) is None


def test_an_engine_short_of_memory_keeps_bf16_matmuls(
    checkpoints: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With too little RAM for fp32 matmul copies beside its cache, an engine on a CPU that
    emulates bf16 matmuls (patched) keeps the bf16 weights, says so, and serves."""
    _, path = checkpoints(ARCH)
    monkeypatch.setattr(loader, "native_gemm", lambda dtype, device="cpu": False)
    monkeypatch.setattr(startup, "available_memory_bytes", lambda device: (GIB // 1024, GIB))
    with caplog.at_level(logging.WARNING, logger="hybridkv.models.loader"):
        llm = LLM(str(path), dtype="bfloat16", cache_memory_gib=0.02, max_model_len=128)
    assert "--cpu-matmul-dtype float32" in caplog.text
    model = llm.engine.runner.model
    assert not any(isinstance(m, Fp32Linear) for m in model.modules())
    out = llm.generate(["Hello there"], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_upcast_estimate_is_what_the_copies_add_in_every_family(
    checkpoints: Any, arch: str
) -> None:
    """upcast_extra_bytes (what the loader weighs before holding fp32 matmul copies):
    exactly the bytes ``matmul_dtype="float32"`` adds, for every family's layout (stacked
    experts with biases, Jamba's ``keep_plain`` dt_proj, Zamba2's shared blocks)."""
    _, path = checkpoints(arch)
    bf16 = loader.load_model(path, "bfloat16", matmul_dtype="model")
    fp32 = loader.load_model(path, "bfloat16", matmul_dtype="float32")
    assert upcast_extra_bytes(bf16.model) == fp32.nbytes - bf16.nbytes > 0


def test_a_draft_model_gets_what_the_target_left_of_the_weights_limit(
    checkpoints: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The weights limit is measured once, before the target loads; the draft model's fp32
    copies must fit in what the target's weights left of it (not in a limit measured anew
    after the target loaded, which would count the target's mapped pages as free and give
    the two models up to 1.5 times the share)."""
    _, target = checkpoints(ARCH)
    _, draft = checkpoints("nemotron_h")
    limits: list[int | None] = []
    real_load = loader.load_model

    def load_model(*args: Any, **kwargs: Any) -> Any:
        limits.append(kwargs.get("weight_memory_limit"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(llm_engine, "load_model", load_model)
    monkeypatch.setattr(setup, "load_model", load_model)
    monkeypatch.setattr(startup, "available_memory_bytes", lambda device: (4 * GIB, 8 * GIB))
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    llm = LLM(str(target), speculative_config=spec, max_model_len=128, cache_memory_gib=0.02)
    limit = int(0.9 * 4 * GIB) - int(0.02 * GIB)
    target_bytes = llm.engine.speculative.target.nbytes
    assert limits == [limit, limit - target_bytes]

"""What the engine decides once at start: the cache size, max_model_len, the capacity report.

The cache is ``cache_memory_gib`` (absolute), or ``gpu_memory_utilization`` times the memory
still available once the weights are loaded: on CPU the RAM the kernel reports as
available (``MemAvailable``), on CUDA the device's total times the fraction minus what is
already in use (vLLM's meaning). max_model_len is the user's, else the model's, lowered to
the longest sequence the cache holds (the report says so, by how much and why). The
capacity report is :func:`hybridkv.core.planner.plan` for exactly these settings, so it is
what ``hybridkv plan`` prints for them; it names that command.
"""

from __future__ import annotations

import logging
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridkv.core.layout import ArenaLayout
from hybridkv.core.planner import (
    DEFAULT_MAX_MODEL_LEN,
    Plan,
    max_seq_len,
    plan,
    state_pages_per_seq,
)
from hybridkv.core.report import capacity_lines
from hybridkv.core.spec import ModelSpec, RecurrentStateSpec
from hybridkv.core.units import GIB
from hybridkv.engine.config import EngineConfig

logger = logging.getLogger("hybridkv.engine")


@dataclass(frozen=True, slots=True)
class CacheBudget:
    bytes: int
    source: str  # how it was decided, for messages: "cache_memory_gib 2" ...


def available_memory_bytes(device: torch.device) -> tuple[int, int]:
    """(available, total) bytes of ``device``'s memory right now."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    fields: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    page = os.sysconf("SC_PAGE_SIZE")
    total = fields.get("MemTotal") or os.sysconf("SC_PHYS_PAGES") * page
    available = fields.get("MemAvailable") or os.sysconf("SC_AVPHYS_PAGES") * page
    return int(available), int(total)


# of the RAM available before the load, what the weights may take (the loader's limit on
# holding matmul weights in fp32): beside a fixed cache, all but a tenth (activations, the
# heap, the tokenizer); with a cache sized by gpu_memory_utilization from what the weights
# leave, half (so the fp32 copies cannot shrink that cache below half the RAM's share)
WEIGHTS_SHARE_BESIDE_FIXED_CACHE = 0.9
WEIGHTS_SHARE_BESIDE_SIZED_CACHE = 0.5


def weight_memory_limit(config: EngineConfig, device: torch.device) -> int | None:
    """How many bytes the loaded weights may take (None off the CPU), measured now, before
    the load: the limit past which "auto" keeps a bf16 model's matmuls in bf16 rather than
    holding fp32 copies (hybridkv.models.loader). A negative limit (the fixed cache alone
    passes the available RAM) leaves the model dtype too; the cache itself is checked later."""
    if device.type != "cpu":
        return None
    available, _ = available_memory_bytes(device)
    fixed = config.fixed_cache_memory_bytes
    if fixed is None:
        return int(WEIGHTS_SHARE_BESIDE_SIZED_CACHE * available)
    return int(WEIGHTS_SHARE_BESIDE_FIXED_CACHE * available) - fixed


def cache_budget(config: EngineConfig, device: torch.device) -> CacheBudget:
    """The cache size in bytes (call after the weights are loaded).

    Raises:
        ValueError: gpu_memory_utilization leaves nothing for the cache.
    """
    fixed = config.fixed_cache_memory_bytes
    if fixed is not None:
        return CacheBudget(fixed, f"cache_memory_gib {config.cache_memory_gib or fixed / GIB:g}")
    util = config.gpu_memory_utilization
    assert util is not None
    available, total = available_memory_bytes(device)
    if device.type == "cuda":  # vLLM: the instance may use util * total in all
        budget = available - int((1 - util) * total)
        where = f"{util:g} of the device's {total / GIB:.1f} GiB, {available / GIB:.1f} GiB free"
    else:
        budget = int(util * available)
        where = f"{util:g} of the {available / GIB:.1f} GiB of RAM available"
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization {util:g} leaves no memory for the cache ({where}); "
            f"raise it or give cache_memory_gib"
        )
    return CacheBudget(budget, f"gpu_memory_utilization {where}")


@dataclass(frozen=True, slots=True)
class LengthChoice:
    tokens: int
    note: str | None  # why it is not what the user or the model asked for


def choose_max_model_len(
    config: EngineConfig,
    layout: ArenaLayout,
    spec: ModelSpec,
    native: int | None,
    budget: CacheBudget,
) -> LengthChoice:
    """The user's max_model_len if one sequence of it fits, else the model's, lowered to fit.

    Raises:
        ValueError: the user's length, or one block, does not fit in the cache.
    """
    speculative = config.speculative  # scratch states of a speculative step count too
    k = speculative.num_speculative_tokens if speculative else 0
    fits = max_seq_len(layout, spec, config.block_size, state_pages_per_seq(spec, k))
    if config.max_model_len is not None:
        if config.max_model_len > fits:
            raise ValueError(
                f"max_model_len={config.max_model_len} does not fit in the cache: "
                f"{budget.source} holds one sequence of at most {fits} tokens; raise "
                f"cache_memory_gib / gpu_memory_utilization or lower max_model_len"
            )
        return LengthChoice(config.max_model_len, None)
    if fits <= 0:
        raise ValueError(f"{budget.source} cannot hold one sequence of this model; raise it")
    if native is None:
        return LengthChoice(min(fits, DEFAULT_MAX_MODEL_LEN), None)
    if native <= fits:
        return LengthChoice(native, None)
    note = (
        f"max_model_len lowered from the model's {native:,} to {fits:,} tokens "
        f"({100 * fits / native:.1f}%, {native - fits:,} fewer): {budget.source} holds one "
        f"sequence of at most {fits:,} tokens with its states; raise cache_memory_gib / "
        f"gpu_memory_utilization to serve longer ones"
    )
    return LengthChoice(fits, note)


def plan_command(config: EngineConfig, spec: ModelSpec, budget: CacheBudget, length: int) -> str:
    """The ``hybridkv plan`` command that prints this engine's capacity numbers."""
    kv, conv, ssm = spec_dtypes(spec)
    argv = [
        "hybridkv",
        "plan",
        str(config.model),
        "--memory-gib",
        gib_text(budget.bytes),
        "--max-num-seqs",
        str(config.max_num_seqs),
        "--max-model-len",
        str(length),
        "--block-size",
        str(config.block_size),
    ]
    for flag, dtype in (("--kv-dtype", kv), ("--conv-dtype", conv), ("--ssm-dtype", ssm)):
        if dtype is not None:
            argv += [flag, dtype]
    speculative = config.speculative
    if speculative is not None:
        argv += ["--num-speculative-tokens", str(speculative.num_speculative_tokens)]
        if speculative.model is not None:  # a draft model's layers share the arena
            argv += ["--draft-model", str(speculative.model)]
    return shlex.join(argv)


def gib_text(num_bytes: int) -> str:
    """The shortest GiB figure that ``hybridkv plan`` turns back into ``num_bytes``."""
    for digits in range(1, 18):
        text = f"{num_bytes / GIB:.{digits}g}"
        if int(float(text) * GIB) == num_bytes:
            return text
    return repr(num_bytes / GIB)


def spec_dtypes(spec: ModelSpec) -> tuple[str | None, str | None, str | None]:
    """(KV, conv state, SSM state) dtypes of ``spec`` (None where the model has none)."""
    found: dict[str, str] = {}
    for layer in spec.layers:
        if isinstance(layer.spec, RecurrentStateSpec):
            found.update((t.name, t.dtype) for t in layer.spec.tensors)
        else:
            found["kv"] = layer.spec.dtype
    return found.get("kv"), found.get("conv"), found.get("ssm")


def capacity_plan(config: EngineConfig, spec: ModelSpec, budget: CacheBudget, length: int) -> Plan:
    """:func:`hybridkv.core.planner.plan` for this engine's settings."""
    speculative = config.speculative
    return plan(
        spec,
        budget.bytes,
        max_num_seqs=config.max_num_seqs,
        max_model_len=length,
        block_tokens=config.block_size,
        num_speculative_tokens=speculative.num_speculative_tokens if speculative else 0,
    )


def log_capacity(
    report: Plan, command: str, length: LengthChoice, budget: CacheBudget
) -> list[str]:
    """Log the capacity report (INFO; the max_model_len note as a WARNING); the lines."""
    lines = capacity_lines(report, plan_command=command, memory_source=budget.source)
    if length.note:
        lines.insert(0, length.note)
        logger.warning("%s", length.note)
    for line in lines[1 if length.note else 0 :]:
        logger.info("%s", line)
    return lines


def read_chat_template(value: str) -> str:
    """``--chat-template``: a file's contents, or the template itself (vLLM's rule).

    Raises:
        ValueError: it looks like a path (no template syntax) but no such file exists.
    """
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a long inline template is not a valid path
        pass
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"chat_template {value!r}: no such file, and not a Jinja template")

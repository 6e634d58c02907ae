"""EngineConfig: every engine option in one validated place, under vLLM's names.

The command line and ``LLM(**options)`` are generated from this dataclass
(:mod:`hybridkv.cli.config_args`): a field is a flag ``--field-name`` with the field's
default, its line of the ``Attributes`` section below as help, and what its metadata adds
(``choices``, ``aliases``, a ``parse`` function for the flag's text, ``cli=False`` to keep
it off the command line). A new field therefore gets its flag without touching the CLI.

vLLM's names are the primary ones where the meaning is the same (``max_model_len``,
``gpu_memory_utilization``, ``enable_prefix_caching``, ``kv_cache_dtype``,
``generation_config``, ``chat_template``, ...); options vLLM has no word for keep ours
(``cache_memory_gib``, ``eviction``, ``checkpoint_interval``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridkv.core.checkpoint import CheckpointPolicy
from hybridkv.core.eviction import EvictionPolicy
from hybridkv.core.units import GIB
from hybridkv.engine.spec_decode.config import SpeculativeConfig

DEFAULT_CACHE_MEMORY_GIB = 2.0  # vLLM's CPU backend reserves 4 GiB; our test models are tiny
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# the offline API's (LLM's): vLLM's CPU defaults are 4096 for its LLM class and 2048 for its
# server (engine/arg_utils.py); offline, nobody waits for a first token, so a step may
# prefill twice as much (64 prompts of 48 tokens in one step, not two)
OFFLINE_MAX_NUM_BATCHED_TOKENS = 4096
# the offline API's decode bursts (hybridkv.engine.decode_burst): a block's worth, with no
# time budget (nobody streams): the tiny model's 64 x 32 equal replies in 2 decode rounds,
# not 4. The server keeps 8 within 25 ms: longer bursts there lowered caching off's
# time to first token more than caching on's (tests' chat workload, engine_multiturn.py)
OFFLINE_DECODE_BURST = 16
DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"float": "float32", "half": "float16"}  # vLLM's --dtype accepts these too
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
MAMBA_SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
MATMUL_DTYPES = ("auto", "model", "float32")  # the loader's matmul_dtype
MAMBA_CACHE_MODES = ("align", "none")  # vLLM's; "align" is how every snapshot here is taken
EVICTION_POLICIES = {"lru": EvictionPolicy.LRU, "cost": EvictionPolicy.COST}
GENERATION_CONFIG_SOURCES = ("auto", "vllm")  # or a path


def loader_cache_dtype(name: str) -> str | None:
    """A cache dtype option as the loader takes it: None for 'auto', fp8 by torch's name."""
    return {
        "auto": None,
        "fp8": "float8_e4m3fn",
        "fp8_e4m3": "float8_e4m3fn",
        "fp8_e5m2": "float8_e5m2",
    }.get(name, name)


def human_readable_int(text: str) -> int:
    """vLLM's integer flags: ``32k`` is 32,000, ``32K`` is 32,768, ``25.6k`` is 25,600.

    Raises:
        ValueError: not an integer, or a decimal with a binary suffix (``1.5K``).
    """
    text = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text)
    if not match:
        return int(text)
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    if "." in number:
        raise ValueError(
            f"{text}: no decimals with a binary suffix ({suffix}); did you mean "
            f"{number}{suffix.lower()}?"
        )
    return int(number) * 1024 ** ("KMGT".index(suffix) + 1)


def max_model_len_arg(text: str) -> int | None:
    """``--max-model-len``: a human-readable integer, or ``auto`` / ``-1`` (fit the cache)."""
    if text.strip().lower() in ("auto", "-1"):
        return None
    return human_readable_int(text)


def optional_float_arg(text: str) -> float | None:
    """A flag's number, or ``none`` for no bound (``--decode-burst-budget-ms none``)."""
    return None if text.strip().lower() == "none" else float(text)


def json_object_arg(text: str) -> dict[str, Any]:
    """A flag's JSON object (``--speculative-config``); ValueError otherwise."""
    value = json.loads(text)  # JSONDecodeError is a ValueError
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object")
    return value


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How the engine is built.

    Attributes:
        model: checkpoint directory (config.json, *.safetensors, tokenizer.json).
        tokenizer: directory of tokenizer.json / tokenizer_config.json when they are not
            in the model directory.
        max_model_len: prompt + output tokens of one sequence at most ('32k', '32K' and
            'auto' accepted); default: the model's max_position_embeddings if the cache holds
            one such sequence, else the most it holds (the startup report says so and why).
        max_num_seqs: sequences running at once at most.
        max_num_batched_tokens: tokens in one step (prefill chunks + decodes) at most
            (default 2048; ``LLM``'s 4096, vLLM's CPU defaults for its server and LLM).
        gpu_memory_utilization: the cache gets this fraction of the device's memory still
            available once the weights are loaded; on CPU, of the available RAM
            (MemAvailable). Give it or cache_memory_gib; neither: 2 GiB.
        cache_memory_gib: the cache arena (KV pages and state pages), in GiB (default 2).
        block_size: tokens per attention page (and the grid of state snapshots).
        enable_prefix_caching: reuse KV pages and state snapshots across requests.
        mamba_cache_mode: vLLM's switch for caching recurrent states: 'align' (snapshots at
            block-aligned positions, how this engine takes all of them) needs prefix
            caching; 'none' turns prefix caching off. Default: follow
            enable_prefix_caching.
        dtype: model dtype; 'auto' is float32 on CPU, else the checkpoint's dtype.
        kv_cache_dtype: KV cache dtype; 'auto' is the model dtype; fp8 (e4m3, e5m2) stores
            K/V unscaled, as vLLM does without calibrated scales.
        mamba_ssm_cache_dtype: recurrent (SSM) state dtype; 'auto': float32 for a float32
            model, else the model family's rule (the checkpoint's mamba_ssm_dtype if any).
        device: torch device ('cpu', 'cuda', ...).
        pack_weights: on the CPU, lay the large linear weights out once in oneDNN's blocked
            format (see hybridkv.layers.packed_linear): faster small-batch matmuls (a
            decode of 8 rows of the small Qwen3-Next 11.1 -> 8.4 ms), a slower load (the
            checkpoint is read into memory and reordered). None ('auto', the default):
            packs a bf16 model whose weights take at most
            hybridkv.models.loader.AUTO_PACK_MAX_BYTES (512 MiB: ~1.2 s of packing at
            Qwen3.5-0.8B's measured rate; packed bf16 products are the plain ones'
            bits) and multiply in the model dtype; True always, False never
            (--no-pack-weights).
        cpu_matmul_dtype: what a bf16 / fp16 model's matmuls run in: 'auto' is float32 on
            a CPU that only emulates the model dtype's matmuls (AVX2 alone: no AVX-512,
            AVX-NE-CONVERT or AMX; there bf16 runs several times slower than fp32), the
            model dtype elsewhere; 'float32' always (on the CPU); 'model' never. In float32
            the matmul weights take twice their memory and every product is rounded back
            to the model dtype (hybridkv.layers.fp32_matmul); 'auto' keeps the model dtype
            (and warns) where those copies would not fit beside the cache
            (hybridkv.engine.startup.weight_memory_limit). Where bf16 matmuls are
            emulated, attention runs through SDPA whatever this option says.
        enforce_eager: run every op eagerly (vLLM's flag): no torch.compile of the few
            ops that compile (hybridkv.ops.compiled), so start-up skips their compile
            (~1.6 s; ~8 s on a machine whose compile cache is empty), and decode steps are
            slower.
        tensor_parallel_size: accepted for vLLM command lines; only 1 (one device) runs.
        generation_config: default sampling parameters: 'auto' reads the checkpoint's
            generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty,
            max_new_tokens, ...) as vLLM does, 'vllm' ignores it, or a directory / file path.
        override_generation_config: JSON object of sampling defaults applied over
            generation_config (e.g. '{"temperature": 0.5}').
        chat_template: the chat template (a file, or the template itself) replacing the
            tokenizer's.
        trust_remote_code: accepted for vLLM command lines; no checkpoint code ever runs
            here (a warning says so).
        eviction: 'lru' or 'cost' (Marconi-style: tokens saved per byte, with recency).
        eviction_alpha: weight of recency against savings in the 'cost' policy.
        checkpoint_interval: also snapshot recurrent states every N tokens (a multiple of the
            block size), for shared prefixes such as system prompts.
        retention_interval: keep superseded snapshots only on multiples of N tokens.
        seed: seeds the sampling of requests without a seed of their own.
        poison_cache: fill the arena with 0xFF bytes (NaN in every float dtype) at start,
            so a read of cache memory nobody wrote shows up as NaN logits (tests, debugging).
        decode_burst: greedy decode steps one scheduling round may run back to back
            through the decode graph, each feeding its tokens to the next
            (hybridkv.engine.decode_burst; vLLM v0's num_scheduler_steps): the round's
            Python is paid once for all of them. Only when every running request decodes
            plain greedily and nobody waits, and only as many as fit in
            ``decode_burst_budget_ms`` at the recent decode rounds' time per forward; a
            stop inside a burst ends its request there. 1: off.
        decode_burst_budget_ms: how long a decode burst may take (a burst's tokens reach a
            streaming client together, and a request arriving during it waits for its
            end); None (``none`` on the command line): no bound, ``decode_burst`` forwards
            whatever they take (``LLM``'s default, with ``decode_burst`` 16: offline,
            nobody streams).
        speculative_config: speculative decoding, vLLM's dict (``{"method": "ngram",
            "num_speculative_tokens": 4}`` or ``{"method": "draft_model", "model": DIR,
            ...}``, see :class:`SpeculativeConfig`); None: off.
    """

    model: str
    tokenizer: str | None = None
    max_model_len: int | None = field(default=None, metadata={"parse": max_model_len_arg})
    max_num_seqs: int = field(default=64, metadata={"parse": human_readable_int})
    max_num_batched_tokens: int | None = field(default=None, metadata={"parse": human_readable_int})
    gpu_memory_utilization: float | None = None
    cache_memory_gib: float | None = None
    block_size: int = 16
    enable_prefix_caching: bool = field(default=True, metadata={"aliases": ("--prefix-caching",)})
    mamba_cache_mode: str | None = field(default=None, metadata={"choices": MAMBA_CACHE_MODES})
    dtype: str = field(default="auto", metadata={"choices": DTYPES + tuple(DTYPE_ALIASES)})
    kv_cache_dtype: str = field(default="auto", metadata={"choices": KV_CACHE_DTYPES})
    mamba_ssm_cache_dtype: str = field(default="auto", metadata={"choices": MAMBA_SSM_CACHE_DTYPES})
    device: str = "cpu"
    pack_weights: bool | None = None
    cpu_matmul_dtype: str = field(default="auto", metadata={"choices": MATMUL_DTYPES})
    enforce_eager: bool = False
    tensor_parallel_size: int = field(default=1, metadata={"aliases": ("-tp",)})
    generation_config: str = field(default="auto", metadata={"metavar": "auto|vllm|PATH"})
    override_generation_config: dict[str, Any] | None = field(
        default=None, metadata={"metavar": "JSON"}
    )
    chat_template: str | None = None
    trust_remote_code: bool = False
    eviction: str = field(default="lru", metadata={"choices": tuple(EVICTION_POLICIES)})
    eviction_alpha: float = 1.0
    checkpoint_interval: int | None = None
    retention_interval: int | None = None
    seed: int = 0
    poison_cache: bool = field(default=False, metadata={"cli": False})
    decode_burst: int = field(default=8, metadata={"aliases": ("--num-scheduler-steps",)})
    decode_burst_budget_ms: float | None = field(
        default=25.0, metadata={"parse": optional_float_arg, "metavar": "MS"}
    )
    speculative_config: Mapping[str, Any] | SpeculativeConfig | None = field(
        default=None, metadata={"metavar": "JSON", "parse": json_object_arg}
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        for name in ("max_model_len", "max_num_batched_tokens"):
            _check_positive_int(name, getattr(self, name), allow_none=True)
        for name in ("max_num_seqs", "block_size", "decode_burst"):
            _check_positive_int(name, getattr(self, name))
        self._check_memory()
        budget = self.decode_burst_budget_ms
        if budget is not None and (
            isinstance(budget, bool)
            or not isinstance(budget, int | float)
            or not 0 < budget < math.inf
        ):
            raise ValueError(
                f"decode_burst_budget_ms must be positive and finite, or None, got {budget!r}"
            )
        for name, allowed in (
            ("dtype", DTYPES),
            ("kv_cache_dtype", KV_CACHE_DTYPES),
            ("mamba_ssm_cache_dtype", MAMBA_SSM_CACHE_DTYPES),
            ("cpu_matmul_dtype", MATMUL_DTYPES),
            ("eviction", tuple(EVICTION_POLICIES)),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.mamba_cache_mode not in (None, *MAMBA_CACHE_MODES):
            raise ValueError(
                f"mamba_cache_mode must be one of {MAMBA_CACHE_MODES}, "
                f"got {self.mamba_cache_mode!r}"
            )
        if self.mamba_cache_mode == "align" and not self.enable_prefix_caching:
            raise ValueError(
                "mamba_cache_mode 'align' caches states for prefix caching: it needs "
                "enable_prefix_caching"
            )
        if self.tensor_parallel_size != 1:
            raise ValueError(
                f"tensor_parallel_size must be 1, got {self.tensor_parallel_size!r}: this "
                f"engine runs one model on one device"
            )
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(
                f"generation_config must be 'auto', 'vllm' or a path, got "
                f"{self.generation_config!r}"
            )
        if self.override_generation_config is not None and not isinstance(
            self.override_generation_config, dict
        ):
            raise ValueError("override_generation_config must be a JSON object (a dict)")
        self.checkpoint_policy.validate(self.block_size)
        _ = self.speculative  # a bad speculative_config fails here, naming the key

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The validated speculative config, None when speculation is off."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.parse(self.speculative_config)

    def _check_memory(self) -> None:
        if self.cache_memory_gib is not None and self.gpu_memory_utilization is not None:
            raise ValueError(
                "give cache_memory_gib (an absolute size) or gpu_memory_utilization (a "
                "fraction of the available memory), not both"
            )
        gib = self.cache_memory_gib
        if gib is not None and not (_is_number(gib) and math.isfinite(gib) and gib > 0):
            raise ValueError(f"cache_memory_gib must be a positive number, got {gib!r}")
        util = self.gpu_memory_utilization
        if util is not None and not (_is_number(util) and 0 < util <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")

    @property
    def enables_prefix_caching(self) -> bool:
        """Prefix caching after mamba_cache_mode: 'none' turns it off, as in vLLM."""
        return self.enable_prefix_caching and self.mamba_cache_mode != "none"

    @property
    def fixed_cache_memory_bytes(self) -> int | None:
        """The cache size when it does not depend on free memory (None: it does)."""
        if self.gpu_memory_utilization is not None:
            return None
        return int((self.cache_memory_gib or DEFAULT_CACHE_MEMORY_GIB) * GIB)

    @property
    def checkpoint_policy(self) -> CheckpointPolicy:
        return CheckpointPolicy(
            interval_tokens=self.checkpoint_interval,
            retention_interval_tokens=self.retention_interval,
        )

    @property
    def eviction_policy(self) -> EvictionPolicy:
        return EVICTION_POLICIES[self.eviction]


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_positive_int(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")

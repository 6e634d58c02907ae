"""Engine options on the command line, shared by ``serve``, ``generate`` and ``bench``.

One flag per :class:`hybridkv.engine.config.EngineConfig` field, same names with dashes,
same defaults, so the CLI, the server and the Python API never drift apart.
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from hybridkv.engine.config import (
    DEFAULT_CACHE_MEMORY_GIB,
    DTYPES,
    EVICTION_POLICIES,
    EngineConfig,
)


def add_engine_args(parser: argparse.ArgumentParser, *, model_required: bool = True) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        required=model_required,
        default=None,
        help="checkpoint directory (config.json, *.safetensors, tokenizer.json)",
    )
    group.add_argument("--max-model-len", type=int, default=None, help="tokens per sequence")
    group.add_argument("--max-num-seqs", type=int, default=64, help="running sequences at most")
    group.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="tokens per step at most"
    )
    group.add_argument(
        "--cache-memory-gib",
        type=float,
        default=DEFAULT_CACHE_MEMORY_GIB,
        help=f"arena for KV and state pages (default {DEFAULT_CACHE_MEMORY_GIB})",
    )
    group.add_argument("--block-size", type=int, default=16, help="tokens per attention page")
    group.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="turn the prefix cache (KV pages and state snapshots) off",
    )
    group.add_argument("--dtype", choices=DTYPES, default="auto")
    group.add_argument("--device", default="cpu", help="torch device (cpu, cuda, ...)")
    group.add_argument("--eviction", choices=sorted(EVICTION_POLICIES), default="lru")
    group.add_argument(
        "--checkpoint-interval",
        type=int,
        default=None,
        help="also snapshot recurrent states every N tokens (a multiple of the block size)",
    )
    group.add_argument(
        "--retention-interval",
        type=int,
        default=None,
        help="keep superseded snapshots only on multiples of N tokens",
    )
    group.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The EngineConfig the parsed flags describe (``overrides`` win, e.g. a default model).

    Raises:
        ValueError: a flag value EngineConfig rejects (the message names it).
    """
    names = {f.name for f in fields(EngineConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(overrides)
    return EngineConfig(**values)

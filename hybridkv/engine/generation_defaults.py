"""Default sampling parameters from the checkpoint's ``generation_config.json``, as vLLM reads it.

vLLM (``ModelConfig.get_diff_sampling_param``) takes these keys of the file and nothing
else: ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``, ``temperature``,
``top_k``, ``top_p``, ``min_p``, ``max_new_tokens`` (as ``max_tokens``) and
``skip_special_tokens``; ``do_sample`` is ignored, so a file with ``top_k: 1`` makes unseeded
requests deterministic. ``--generation-config vllm`` ignores the file,
``--generation-config PATH`` reads another one, and ``--override-generation-config`` JSON
goes over either. The defaults fill what a request leaves unset: ``LLM.generate`` without
``sampling_params``, and the server's requests for every field they do not send.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
SAMPLING_KEYS = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
    "skip_special_tokens",
)


def read_generation_config(source: str, model_dir: Path) -> dict[str, Any]:
    """The generation config ``source`` names: {} for 'vllm', the model's file for 'auto'.

    Raises:
        ValueError: a path that is neither a generation_config.json nor a directory holding
            one, or a file that is not a JSON object.
    """
    if source == "vllm":
        return {}
    if source == "auto":
        path = model_dir / GENERATION_CONFIG_FILE
        if not path.is_file():
            return {}
    else:
        path = Path(source)
        if path.is_dir():
            path = path / GENERATION_CONFIG_FILE
        if not path.is_file():
            raise ValueError(
                f"generation_config {source!r}: no such file (give 'auto', 'vllm', a "
                f"{GENERATION_CONFIG_FILE} or a directory holding one)"
            )
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"generation_config {path}: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"generation_config {path}: not a JSON object")
    return config


def default_sampling(
    source: str, model_dir: Path, overrides: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """SamplingParams fields the generation config sets (vLLM's ``get_diff_sampling_param``).

    Raises:
        ValueError: see :func:`read_generation_config`.
    """
    config = read_generation_config(source, model_dir) | dict(overrides or {})
    defaults = {key: config[key] for key in SAMPLING_KEYS if config.get(key) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    if defaults and source != "vllm":
        where = "the model's generation_config.json" if source == "auto" else source
        logger.warning(
            "default sampling parameters set by %s: %s (--generation-config vllm ignores it)",
            where,
            defaults,
        )
    return defaults


__all__ = ["GENERATION_CONFIG_FILE", "SAMPLING_KEYS", "default_sampling", "read_generation_config"]

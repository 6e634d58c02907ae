"""Load a Hugging Face checkpoint directory: config, layer specs, weights, tokenizer.

The config is read once: :func:`hybridkv.core.model_config.model_spec_from_config` gives the
cache specs (the same ones the planner counts), and the flattened text config builds the
modules. Weights stream tensor by tensor from one or many safetensors files.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open
from torch import Tensor

from hybridkv.core.model_config import flatten_text_config, model_spec_from_config
from hybridkv.core.spec import ModelSpec, canonical_dtype
from hybridkv.forward.views import TORCH_DTYPES
from hybridkv.models.base import CausalLM
from hybridkv.models.registry import model_class
from hybridkv.models.tokenizer import Tokenizer

MODEL_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: CausalLM
    spec: ModelSpec
    tokenizer: Tokenizer | None  # None when the directory has no tokenizer.json
    config: dict[str, Any]  # the text config (VLM wrappers flattened)
    dtype: str  # the model dtype chosen ("auto" resolved)


def resolve_dtype(dtype: str, device: str, raw_config: dict[str, Any]) -> str:
    """ "auto": float32 on CPU (bf16 matmuls are slow there), else the checkpoint's dtype."""
    if dtype != "auto":
        return dtype
    if device == "cpu":
        return "float32"
    text = raw_config.get("text_config") or raw_config
    named = (
        text.get("torch_dtype")
        or text.get("dtype")
        or raw_config.get("torch_dtype")
        or raw_config.get("dtype")
    )
    return named if named in MODEL_DTYPES else "bfloat16"


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files: the shards of ``model.safetensors.index.json`` or every *.safetensors.

    Raises:
        FileNotFoundError: no safetensors file in the directory.
    """
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors weights")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) of every tensor, one at a time, so peak memory stays one tensor."""
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                yield name, f.get_tensor(name)


def load_model(model_dir: str | Path, dtype: str = "bfloat16", device: str = "cpu") -> LoadedModel:
    """Build the model of ``model_dir`` in ``dtype`` and load its weights.

    ``dtype`` "auto" is resolved by :func:`resolve_dtype` for ``device`` (the model is
    built on the CPU; the caller moves it). Cache dtypes: KV and conv state in ``dtype``;
    the SSM state by the core's family rule, except that an fp32 model keeps everything
    in fp32.

    Raises:
        ValueError: unsupported dtype or model type.
        KeyError / FileNotFoundError: the checkpoint is incomplete.
    """
    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    dtype = canonical_dtype(resolve_dtype(dtype, device, raw))
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"model dtype must be one of {MODEL_DTYPES}, not {dtype!r}")
    spec = model_spec_from_config(
        raw,
        name=model_dir.name,
        kv_dtype=dtype,
        conv_dtype=dtype,
        ssm_dtype="float32" if dtype == "float32" else None,
    )
    cfg = flatten_text_config(raw)
    model = model_class(spec.model_type)(cfg, spec)
    for param in model.parameters():  # buffers (RoPE frequencies) stay fp32
        param.data = param.data.to(TORCH_DTYPES[dtype])
    model.load_weights(iter_safetensors(safetensors_files(model_dir)))
    model.eval()
    tokenizer = Tokenizer(model_dir) if (model_dir / "tokenizer.json").is_file() else None
    return LoadedModel(model=model, spec=spec, tokenizer=tokenizer, config=cfg, dtype=dtype)


__all__ = ["LoadedModel", "load_model", "resolve_dtype"]

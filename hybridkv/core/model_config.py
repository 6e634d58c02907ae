"""config.json → :class:`ModelSpec`: the one place that reads a model's cache geometry.

The planner, the simulator and the model loader all call :func:`load_model_spec`, so the
byte counts the planner reports are the ones the engine allocates.

Sources accepted: a built-in name (the files in ``model_data/``), a path to a
``config.json`` or to a checkpoint directory, or an already parsed dict. Real Qwen3.5
checkpoints are vision-language wrappers whose language model sits under ``text_config``;
its keys win over the wrapper's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from hybridkv.core.families import (
    FAMILIES,
    Dtypes,
    Family,
    Mixer,
    ModelConfigError,
    attention_spec,
    get,
    layer_pattern,
)
from hybridkv.core.spec import LayerCache, ModelSpec, canonical_dtype

_DATA_PACKAGE = "hybridkv.core.model_data"
_ASSUMPTIONS_FILE = "ASSUMPTIONS.json"


def builtin_model_names() -> list[str]:
    """Names accepted as MODEL: the shipped config files without ``.json``."""
    files = resources.files(_DATA_PACKAGE).iterdir()
    return sorted(
        f.name.removesuffix(".json")
        for f in files
        if f.name.endswith(".json") and f.name != _ASSUMPTIONS_FILE
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path} is not valid JSON: {exc.msg} (line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path} does not hold a JSON object")
    return data


def load_config_dict(source: str | Path) -> tuple[str, dict[str, Any]]:
    """Read a model config by built-in name or path. Returns (display name, raw dict).

    Built-in files get the values that their ``_derived`` notes assume (ASSUMPTIONS.json),
    because the published copies leave a few fields out.

    Raises:
        ModelConfigError: unknown name, missing file, or not a JSON object.
    """
    text = str(source)
    if text in builtin_model_names():
        data_dir = resources.files(_DATA_PACKAGE)
        raw = json.loads(data_dir.joinpath(f"{text}.json").read_text())
        assumed = json.loads(data_dir.joinpath(_ASSUMPTIONS_FILE).read_text())
        raw.update(assumed.get(text, {}).get("fields", {}))
        return text, raw
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"{source}: directory has no config.json")
    if not path.is_file():
        hint = "a built-in name (see `hybridkv plan --list`) or a path to a config.json / model dir"
        raise ModelConfigError(f"unknown model {text!r}: not {hint}")
    return path.parent.name if path.name == "config.json" else path.stem, _read_json(path)


def flatten_text_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Merge a VLM wrapper's ``text_config`` over its top level (the text model wins)."""
    cfg = dict(raw)
    text = raw.get("text_config")
    if isinstance(text, Mapping):
        cfg.update({k: v for k, v in text.items() if v is not None})
        cfg["wrapper_model_type"] = raw.get("model_type")
    return cfg


def _model_type(cfg: Mapping[str, Any]) -> str:
    model_type = cfg.get("model_type")
    if model_type is None and isinstance(cfg.get("ssm_cfg"), Mapping):
        return "mamba_ssm"
    if not model_type:
        raise ModelConfigError("config has no model_type: not a model config")
    return str(model_type)


def _family(model_type: str) -> Family:
    family = FAMILIES.get(model_type)
    if family is None:
        supported = ", ".join(sorted(FAMILIES))
        raise ModelConfigError(
            f"model_type {model_type!r} is not a supported hybrid or decoder LLM "
            f"(supported: {supported})"
        )
    return family


def resolve_dtypes(
    cfg: Mapping[str, Any],
    family: Family,
    *,
    kv_dtype: str | None = None,
    conv_dtype: str | None = None,
    ssm_dtype: str | None = None,
) -> Dtypes:
    """Cache dtypes: user override, else the family's rule, else the model dtype."""
    model_dtype = canonical_dtype(str(get(cfg, "dtype", "torch_dtype", default="bfloat16")))
    conv = canonical_dtype(conv_dtype) if conv_dtype else model_dtype
    family_ssm = family.default_ssm_dtype(cfg, model_dtype)
    ssm = canonical_dtype(ssm_dtype or family_ssm or conv)
    return Dtypes(kv=canonical_dtype(kv_dtype) if kv_dtype else model_dtype, conv=conv, ssm=ssm)


def model_spec_from_config(
    raw: Mapping[str, Any],
    *,
    name: str = "model",
    kv_dtype: str | None = None,
    conv_dtype: str | None = None,
    ssm_dtype: str | None = None,
) -> ModelSpec:
    """Build the layer specs of a parsed config.json.

    Args:
        raw: the config as read from disk.
        name: display name.
        kv_dtype / conv_dtype / ssm_dtype: overrides of the cache dtypes.

    Raises:
        ModelConfigError: unsupported model type or inconsistent fields.
    """
    cfg = flatten_text_config(raw)
    model_type = _model_type(cfg)
    family = _family(model_type)
    try:
        dtypes = resolve_dtypes(
            cfg, family, kv_dtype=kv_dtype, conv_dtype=conv_dtype, ssm_dtype=ssm_dtype
        )
        num_layers = _num_layers(cfg)
        pattern = layer_pattern(cfg, family.name, num_layers)
        layers = _layer_caches(cfg, model_type, family, dtypes, pattern)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ModelConfigError):
            raise
        raise ModelConfigError(f"config of {name!r} is inconsistent: {exc}") from None
    max_len = get(cfg, "max_position_embeddings", "model_max_length")
    return ModelSpec(
        name=name,
        model_type=model_type,
        num_layers=num_layers,
        dtype=dtypes.kv,
        max_model_len=int(max_len) if max_len else None,
        layers=tuple(layers),
    )


def _num_layers(cfg: Mapping[str, Any]) -> int:
    """Layer count; transformers 5 drops ``num_hidden_layers`` from NemotronH configs it
    saves (the count is the length of ``layers_block_type``), so fall back to the pattern.
    """
    count = get(cfg, "num_hidden_layers", "n_layer")
    if count is not None:
        return int(count)
    for field in ("layers_block_type", "layer_types", "hybrid_override_pattern"):
        if isinstance(cfg.get(field), list | str):
            return len(cfg[field])
    raise ModelConfigError("config has no num_hidden_layers and no layer pattern to count")


def _layer_caches(
    cfg: Mapping[str, Any], model_type: str, family: Family, dtypes: Dtypes, pattern: list[Mixer]
) -> list[LayerCache]:
    wants_attention = any(m in (Mixer.ATTENTION, Mixer.BOTH) for m in pattern)
    wants_state = any(m in (Mixer.RECURRENT, Mixer.BOTH) for m in pattern)
    attn = attention_spec(cfg, family.name, dtypes.kv) if wants_attention else None
    if wants_state and family.state is None:
        raise ModelConfigError(f"{model_type} has recurrent layers but no state rule")
    state = family.state(cfg, model_type, dtypes) if wants_state and family.state else None
    layers: list[LayerCache] = []
    for index, mixer in enumerate(pattern):
        if attn is not None and mixer in (Mixer.ATTENTION, Mixer.BOTH):
            layers.append(LayerCache(layer_index=index, name="attn", spec=attn))
        if state is not None and mixer in (Mixer.RECURRENT, Mixer.BOTH):
            layers.append(LayerCache(layer_index=index, name="state", spec=state))
    if not layers:
        raise ModelConfigError(f"{model_type} config describes no layer with a cache")
    return layers


def load_model_spec(
    source: str | Path,
    *,
    kv_dtype: str | None = None,
    conv_dtype: str | None = None,
    ssm_dtype: str | None = None,
) -> ModelSpec:
    """Layer specs of a built-in model name, a config.json path or a checkpoint directory."""
    name, raw = load_config_dict(source)
    return model_spec_from_config(
        raw, name=name, kv_dtype=kv_dtype, conv_dtype=conv_dtype, ssm_dtype=ssm_dtype
    )

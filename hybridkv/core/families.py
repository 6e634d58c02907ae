"""Per-family rules: which layers carry which cache, and the exact state geometry.

Each model family writes its layer pattern and its mixer sizes under different keys,
and real checkpoints still use older forms (see notes/transformers-reference-on-cpu.md,
pitfall 8). Every rule below reads the forms real config.json files use and falls back
to the transformers config defaults for keys a checkpoint leaves out.

The state formulas are vLLM's (``mamba_utils.py``): the conv state keeps ``kernel - 1``
columns, the SSM state its full shape, and the Mamba2 inner width comes from the heads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from hybridkv.core.spec import (
    AttentionSpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
    StateKind,
    StateTensorSpec,
)

Config = Mapping[str, Any]


class ModelConfigError(ValueError):
    """A config that cannot be turned into layer specs; the message names the problem."""


class Mixer(Enum):
    """What a decoder layer holds in the cache."""

    ATTENTION = "attention"
    RECURRENT = "recurrent"
    BOTH = "both"  # Zamba2 hybrid layers, Falcon-H1 (attention ∥ mamba)
    NONE = "none"  # NemotronH '-' (MLP) and 'E' (MoE) layers


@dataclass(frozen=True, kw_only=True, slots=True)
class Dtypes:
    """Cache dtypes after the family rules and the user's overrides."""

    kv: str
    conv: str
    ssm: str


def get(cfg: Config, *keys: str, default: Any = None) -> Any:
    """First key present with a non-null value, else ``default``."""
    for key in keys:
        value = cfg.get(key)
        if value is not None:
            return value
    return default


def require(cfg: Config, *keys: str) -> Any:
    value = get(cfg, *keys)
    if value is None:
        raise ModelConfigError(f"config has no {' / '.join(keys)}")
    return value


# ----------------------------------------------------------------------------- patterns

_TYPE_WORDS: dict[str, Mixer] = {
    "linear_attention": Mixer.RECURRENT,
    "mamba": Mixer.RECURRENT,
    "mamba2": Mixer.RECURRENT,
    "conv": Mixer.RECURRENT,
    "kda": Mixer.RECURRENT,
    "m": Mixer.RECURRENT,
    "full_attention": Mixer.ATTENTION,
    "attention": Mixer.ATTENTION,
    "sliding_attention": Mixer.ATTENTION,
    "hybrid": Mixer.BOTH,
    "g": Mixer.BOTH,
    "mlp": Mixer.NONE,
    "moe": Mixer.NONE,
}

_NEMOTRON_LETTERS: dict[str, Mixer] = {
    "M": Mixer.RECURRENT,
    "*": Mixer.ATTENTION,
    "-": Mixer.NONE,
    "E": Mixer.NONE,
}


def _from_words(words: list[str], field: str) -> list[Mixer]:
    try:
        return [_TYPE_WORDS[str(w).lower()] for w in words]
    except KeyError as exc:
        raise ModelConfigError(f"unknown layer type {exc.args[0]!r} in {field}") from None


def _from_indices(num_layers: int, indices: list[int], hit: Mixer, miss: Mixer) -> list[Mixer]:
    bad = [i for i in indices if not 0 <= i < num_layers]
    if bad:
        raise ModelConfigError(f"layer indices {bad} out of range for {num_layers} layers")
    chosen = set(indices)
    return [hit if i in chosen else miss for i in range(num_layers)]


def layer_pattern(cfg: Config, family: str, num_layers: int) -> list[Mixer]:
    """The mixer of every decoder layer, from whichever pattern field the config has."""
    pattern = _pattern(cfg, family, num_layers)
    if len(pattern) != num_layers:
        raise ModelConfigError(
            f"layer pattern has {len(pattern)} entries but num_hidden_layers is {num_layers}"
        )
    return pattern


def _pattern(cfg: Config, family: str, n: int) -> list[Mixer]:
    if family == "falcon_h1":
        return [Mixer.BOTH] * n
    if family == "kimi_linear" and isinstance(cfg.get("linear_attn_config"), Mapping):
        full = cfg["linear_attn_config"].get("full_attn_layers") or []
        return _from_indices(n, [i - 1 for i in full], Mixer.ATTENTION, Mixer.RECURRENT)  # 1-based
    if isinstance(cfg.get("hybrid_override_pattern"), str):
        letters = cfg["hybrid_override_pattern"]
        unknown = sorted(set(letters) - set(_NEMOTRON_LETTERS))
        if unknown:
            raise ModelConfigError(f"unknown letters {unknown} in hybrid_override_pattern")
        return [_NEMOTRON_LETTERS[c] for c in letters]
    for field in ("layer_types", "layers_block_type", "standalone_layer_mapping"):
        if isinstance(cfg.get(field), list):
            return _from_words(cfg[field], field)
    if family == "zamba2" and isinstance(cfg.get("hybrid_layer_ids"), list):
        return _from_indices(n, cfg["hybrid_layer_ids"], Mixer.BOTH, Mixer.RECURRENT)
    if isinstance(cfg.get("attn_layer_indices"), list):
        return _from_indices(n, cfg["attn_layer_indices"], Mixer.ATTENTION, Mixer.RECURRENT)
    if isinstance(cfg.get("attn_layer_idx"), list):  # mamba_ssm checkpoints
        return _from_indices(n, cfg["attn_layer_idx"], Mixer.ATTENTION, Mixer.RECURRENT)
    if isinstance(cfg.get("full_attn_idxs"), list):  # LFM2 legacy
        return _from_indices(n, cfg["full_attn_idxs"], Mixer.ATTENTION, Mixer.RECURRENT)
    if cfg.get("attn_layer_period") is not None:  # Jamba
        period, offset = (
            int(cfg["attn_layer_period"]),
            int(get(cfg, "attn_layer_offset", default=0)),
        )
        return [Mixer.ATTENTION if i % period == offset else Mixer.RECURRENT for i in range(n)]
    if family == "gdn":
        interval = int(get(cfg, "full_attention_interval", default=4))
        return [Mixer.ATTENTION if (i + 1) % interval == 0 else Mixer.RECURRENT for i in range(n)]
    if family in ("mamba2", "mamba1"):
        return [Mixer.RECURRENT] * n
    if family == "dense":
        return [Mixer.ATTENTION] * n
    raise ModelConfigError(f"config of family {family!r} has no layer pattern field")


# ----------------------------------------------------------------------------- attention


def attention_spec(cfg: Config, family: str, kv_dtype: str) -> AttentionSpec | SlidingWindowSpec:
    """The KV cache of one attention layer."""
    if family == "kimi_linear":  # MLA caches the compressed latent, one "head"
        return AttentionSpec(
            num_kv_heads=1,
            head_dim=int(require(cfg, "kv_lora_rank")),
            value_head_dim=int(require(cfg, "qk_rope_head_dim")),
            dtype=kv_dtype,
        )
    hidden = int(require(cfg, "hidden_size", "d_model"))
    num_heads = int(require(cfg, "num_attention_heads"))
    num_kv_heads = int(get(cfg, "num_key_value_heads", default=num_heads))
    if family == "zamba2":  # attention runs on concat(hidden, embeddings)
        head_dim = int(get(cfg, "attention_head_dim", default=2 * hidden // num_heads))
    else:
        head_dim = int(get(cfg, "head_dim", "attention_head_dim", default=hidden // num_heads))
    window = cfg.get("sliding_window")
    if window and get(cfg, "use_sliding_window", default=True):
        return SlidingWindowSpec(
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            value_head_dim=head_dim,
            dtype=kv_dtype,
            window_tokens=int(window),
        )
    return AttentionSpec(
        num_kv_heads=num_kv_heads, head_dim=head_dim, value_head_dim=head_dim, dtype=kv_dtype
    )


# ----------------------------------------------------------------------------- states


def _conv(channels: int, kernel: int, dtype: str) -> StateTensorSpec:
    return StateTensorSpec(name="conv", shape=(channels, kernel - 1), dtype=dtype)


def _mamba2_geometry(cfg: Config, model_type: str) -> tuple[int, int, int, int, int]:
    """(heads, head_dim, d_state, n_groups, conv_kernel) under each family's key names."""
    hidden = int(require(cfg, "hidden_size", "d_model"))
    if model_type == "nemotron_h":
        heads = int(get(cfg, "mamba_num_heads", default=128))
        head_dim = int(get(cfg, "mamba_head_dim", default=64))
        return (
            heads,
            head_dim,
            int(get(cfg, "ssm_state_size", default=128)),
            int(get(cfg, "n_groups", default=8)),
            int(get(cfg, "conv_kernel", default=4)),
        )
    if model_type == "zamba2":
        expand = int(get(cfg, "mamba_expand", "expansion_factor", default=2))
        head_dim = int(get(cfg, "mamba_headdim", default=64))
        heads = int(get(cfg, "n_mamba_heads", default=expand * hidden // head_dim))
        return (
            heads,
            head_dim,
            int(get(cfg, "mamba_d_state", "state_size", default=64)),
            int(get(cfg, "mamba_ngroups", default=1)),
            int(get(cfg, "mamba_d_conv", "conv_dimension", default=4)),
        )
    if model_type == "mamba2":
        return (
            int(get(cfg, "num_heads", default=128)),
            int(get(cfg, "head_dim", default=64)),
            int(get(cfg, "state_size", default=128)),
            int(get(cfg, "n_groups", default=8)),
            int(get(cfg, "conv_kernel", default=4)),
        )
    if isinstance(cfg.get("ssm_cfg"), Mapping):  # mamba_ssm MambaLMHeadModel checkpoints
        ssm = cfg["ssm_cfg"]
        expand = int(ssm.get("expand", 2))
        head_dim = int(ssm.get("headdim", 64))
        return (
            expand * hidden // head_dim,
            head_dim,
            int(ssm.get("d_state", 128)),
            int(ssm.get("ngroups", 1)),
            int(ssm.get("d_conv", 4)),
        )
    # bamba, granitemoehybrid, falcon_h1: mamba_* keys, d_head "auto" = expand*hidden/heads
    heads = int(get(cfg, "mamba_n_heads", default=128))
    d_head = get(cfg, "mamba_d_head", default="auto")
    if d_head == "auto":
        d_ssm = get(cfg, "mamba_d_ssm")
        inner = int(d_ssm) if d_ssm else int(get(cfg, "mamba_expand", default=2)) * hidden
        d_head = inner // heads
    return (
        heads,
        int(d_head),
        int(get(cfg, "mamba_d_state", default=256)),
        int(get(cfg, "mamba_n_groups", default=1)),
        int(get(cfg, "mamba_d_conv", default=4)),
    )


def mamba2_state(cfg: Config, model_type: str, dtypes: Dtypes) -> RecurrentStateSpec:
    heads, head_dim, d_state, n_groups, kernel = _mamba2_geometry(cfg, model_type)
    inner = heads * head_dim
    return RecurrentStateSpec(
        kind=StateKind.MAMBA2,
        tensors=(
            _conv(inner + 2 * n_groups * d_state, kernel, dtypes.conv),
            StateTensorSpec(name="ssm", shape=(heads, head_dim, d_state), dtype=dtypes.ssm),
        ),
    )


def mamba1_state(cfg: Config, model_type: str, dtypes: Dtypes) -> RecurrentStateSpec:
    hidden = int(require(cfg, "hidden_size", "d_model"))
    expand = int(get(cfg, "mamba_expand", "expand", default=2))
    if model_type == "jamba":
        inner = expand * hidden
    else:  # mamba, falcon_mamba
        inner = int(get(cfg, "intermediate_size", default=expand * hidden))
    d_state = int(get(cfg, "mamba_d_state", "state_size", default=16))
    kernel = int(get(cfg, "mamba_d_conv", "conv_kernel", default=4))
    return RecurrentStateSpec(
        kind=StateKind.MAMBA1,
        tensors=(
            _conv(inner, kernel, dtypes.conv),
            StateTensorSpec(name="ssm", shape=(inner, d_state), dtype=dtypes.ssm),
        ),
    )


def gdn_state(cfg: Config, model_type: str, dtypes: Dtypes) -> RecurrentStateSpec:
    k_heads = int(get(cfg, "linear_num_key_heads", default=16))
    v_heads = int(get(cfg, "linear_num_value_heads", default=32))
    k_dim = int(get(cfg, "linear_key_head_dim", default=128))
    v_dim = int(get(cfg, "linear_value_head_dim", default=128))
    kernel = int(get(cfg, "linear_conv_kernel_dim", default=4))
    return RecurrentStateSpec(
        kind=StateKind.GATED_DELTANET,
        tensors=(
            _conv(2 * k_heads * k_dim + v_heads * v_dim, kernel, dtypes.conv),
            StateTensorSpec(name="ssm", shape=(v_heads, k_dim, v_dim), dtype=dtypes.ssm),
        ),
    )


def kda_state(cfg: Config, model_type: str, dtypes: Dtypes) -> RecurrentStateSpec:
    linear = cfg.get("linear_attn_config") or {}
    heads = int(get(linear, "num_heads", default=get(cfg, "num_attention_heads", default=32)))
    head_dim = int(get(linear, "head_dim", default=128))
    kernel = int(get(linear, "short_conv_kernel_size", default=4))
    return RecurrentStateSpec(
        kind=StateKind.KDA,
        tensors=(
            _conv(3 * heads * head_dim, kernel, dtypes.conv),  # q, k, v convolved separately
            StateTensorSpec(name="ssm", shape=(heads, head_dim, head_dim), dtype=dtypes.ssm),
        ),
    )


def short_conv_state(cfg: Config, model_type: str, dtypes: Dtypes) -> RecurrentStateSpec:
    channels = int(get(cfg, "conv_dim", "hidden_size"))
    kernel = int(get(cfg, "conv_L_cache", default=3))
    return RecurrentStateSpec(
        kind=StateKind.SHORT_CONV, tensors=(_conv(channels, kernel, dtypes.conv),)
    )


StateBuilder = Callable[[Config, str, Dtypes], RecurrentStateSpec]


@dataclass(frozen=True, kw_only=True, slots=True)
class Family:
    """How one group of model types is read."""

    name: str
    state: StateBuilder | None
    default_ssm_dtype: Callable[[Config, str], str | None]  # None: follow the conv dtype


def _model_dtype_ssm(cfg: Config, model_dtype: str) -> str | None:
    return None


def _qwen_ssm(cfg: Config, model_dtype: str) -> str | None:
    value = get(cfg, "mamba_ssm_dtype")  # Qwen3.5 27B+ ship "float32"; 0.8B and Qwen3-Next do not
    return None if value is None else str(value)


def _nemotron_ssm(cfg: Config, model_dtype: str) -> str | None:
    return str(get(cfg, "mamba_ssm_cache_dtype", default="float32"))  # vLLM: only fp32 is exact


def _kda_ssm(cfg: Config, model_dtype: str) -> str | None:
    return "float32"  # vLLM keeps the KDA recurrent state in fp32 always


_GDN = Family(name="gdn", state=gdn_state, default_ssm_dtype=_qwen_ssm)
_MAMBA2 = Family(name="mamba2", state=mamba2_state, default_ssm_dtype=_model_dtype_ssm)
_MAMBA1 = Family(name="mamba1", state=mamba1_state, default_ssm_dtype=_model_dtype_ssm)
_DENSE = Family(name="dense", state=None, default_ssm_dtype=_model_dtype_ssm)

FAMILIES: dict[str, Family] = {
    "qwen3_next": _GDN,
    "qwen3_5": _GDN,
    "qwen3_5_text": _GDN,
    "qwen3_5_moe": _GDN,
    "qwen3_5_moe_text": _GDN,
    "bamba": _MAMBA2,
    "granitemoehybrid": _MAMBA2,
    "mamba2": _MAMBA2,
    "mamba_ssm": _MAMBA2,
    "nemotron_h": Family(name="mamba2", state=mamba2_state, default_ssm_dtype=_nemotron_ssm),
    "zamba2": Family(name="zamba2", state=mamba2_state, default_ssm_dtype=_model_dtype_ssm),
    "falcon_h1": Family(name="falcon_h1", state=mamba2_state, default_ssm_dtype=_model_dtype_ssm),
    "jamba": _MAMBA1,
    "mamba": _MAMBA1,
    "falcon_mamba": _MAMBA1,
    "lfm2": Family(name="lfm2", state=short_conv_state, default_ssm_dtype=_model_dtype_ssm),
    "lfm2_moe": Family(name="lfm2", state=short_conv_state, default_ssm_dtype=_model_dtype_ssm),
    "kimi_linear": Family(name="kimi_linear", state=kda_state, default_ssm_dtype=_kda_ssm),
    "llama": _DENSE,
    "mistral": _DENSE,
    "qwen2": _DENSE,
    "qwen3": _DENSE,
    "qwen3_moe": _DENSE,
    "granite": _DENSE,
}

"""One tiny random checkpoint per architecture the models support, for engine tests.

The configs are the ones the model tests use (one source of truth): their page sizes do
not divide each other, and constant tensors are perturbed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from hybrid_checks import make_hf
from test_falcon_h1 import CONFIG as FALCON_H1
from test_jamba import CONFIG as JAMBA
from test_lfm2 import CONFIG as LFM2
from test_lfm2_moe import VARIANTS as LFM2_MOE
from test_mamba2_hybrids import CONFIGS as MAMBA2_HYBRIDS
from test_zamba2 import VARIANTS as ZAMBA2
from tiny import CONFIGS as QWEN
from tiny import save_checkpoint

CONFIGS: dict[str, dict[str, Any]] = {
    **QWEN,
    **MAMBA2_HYBRIDS,
    "jamba": JAMBA,
    "lfm2": LFM2,
    "falcon_h1": FALCON_H1,
    "zamba2": ZAMBA2["two_blocks"][1],  # shared blocks, LoRA adapters, one KV cache per use
    "lfm2_moe": LFM2_MOE["base"][1],
}
ARCHITECTURES = sorted(CONFIGS)
# The engine most tests drive (the ``llm`` fixture): tiny Qwen3.5, GDN + gated attention.
ARCH = "qwen3_5_text"
OPTIONS: dict[str, Any] = {"max_model_len": 128, "cache_memory_gib": 0.02, "poison_cache": True}


MIXER_OUTPUTS = ("o_proj", "out_proj", "down_proj")  # what each block adds to the residual


def build_checkpoint(arch: str, model_dir: Path, seed: int = 0, mixer_scale: float = 1.0) -> Any:
    """Save a seeded tiny ``arch`` checkpoint (with the byte tokenizer) into ``model_dir``.

    ``mixer_scale`` < 1 scales every block's output projection: the model is then close to
    a bigram model (the last token's embedding dominates), so its greedy output falls into
    loops an n-gram proposer can copy, while the attention and recurrent layers still
    decide the near ties (a wrong state changes the output). Speculation tests use it.
    """
    hf = make_hf(arch, CONFIGS[arch], seed)
    if mixer_scale != 1.0:
        with torch.no_grad():
            for name, param in hf.named_parameters():
                if any(key in name for key in MIXER_OUTPUTS):
                    param.mul_(mixer_scale)
    save_checkpoint(hf, model_dir)
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    if "layers_block_type" in config:  # transformers 5 drops it for NemotronH; hub files have it
        config.setdefault("num_hidden_layers", len(config["layers_block_type"]))
        config_path.write_text(json.dumps(config))
    return hf


def tight_cache_gib(path: Path, options: dict[str, Any], state_pages: int = 3) -> float:
    """A cache that holds one max_model_len sequence: about one of these requests at a
    time, so running nine at once needs preemption, and caching them needs eviction.
    ``state_pages`` per recurrent group: 3, plus one per draft token when speculating."""
    from hybridkv import LLM

    probe = LLM(str(path), **options)
    layout, spec = probe.engine.manager.layout, probe.engine.spec
    chunks_needed = 0
    for g in spec.groups:
        per_chunk = layout.pages_per_chunk(g.group_id)
        pages = (
            state_pages if g.is_recurrent else -(-options["max_model_len"] // options["block_size"])
        )
        chunks_needed += -(-pages // per_chunk)
    return chunks_needed * layout.chunk_bytes / (1 << 30)

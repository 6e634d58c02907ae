"""Tiny random hybrid checkpoints built locally with transformers (never downloaded).

Shapes are chosen so that no page size divides another: attention 2 KV heads x 24 dims,
GDN 2 k-heads x 16 and 4 v-heads x 12 (two v-heads per k-head, so the grouped head order
of Qwen3-Next's fused projection matters). Constant tensors (norm weights, dt_bias) get
N(0, 0.1) noise: a bug in them would not show otherwise (notes, pitfall 6).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

transformers = __import__("pytest").importorskip("transformers")

VOCAB_SIZE = 260  # 256 byte tokens + 3 specials + 1 spare
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_ID = 258  # <|im_end|>
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

BASE: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 12,
    "linear_conv_kernel_dim": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "initializer_range": 0.1,  # peakier logits than 0.02: fewer near-ties in greedy tests
}
MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}
# model_type -> tiny config; other architectures add their entry here and reuse the helpers.
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_next": {**BASE, **MOE, "decoder_sparse_step": 2},  # layers 1, 3 MoE; 0, 2 dense
    "qwen3_5_text": BASE,
    "qwen3_5_moe_text": {**BASE, **MOE},
}
QWEN_MODEL_TYPES = ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"]


def make_hf(model_type: str, config: dict[str, Any], seed: int = 0) -> Any:
    """A seeded random fp32 transformers model, constant tensors perturbed (pitfall 6)."""
    cfg = transformers.AutoConfig.for_model(model_type, **config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            flat = param.detach().flatten()
            if flat.numel() > 0 and bool((flat == flat[0]).all()):
                param.add_(torch.randn(param.shape, generator=gen) * 0.1)
    model.generation_config.eos_token_id = None
    return model.eval()


def make_hf_model(model_type: str, seed: int = 0, **overrides: Any) -> Any:
    """:func:`make_hf` on the Qwen entry of :data:`CONFIGS`, with ``overrides`` on top."""
    return make_hf(model_type, {**CONFIGS[model_type], **overrides}, seed)


def write_tokenizer(model_dir: Path) -> None:
    """Byte-level tokenizer: 256 byte tokens, specials at 256.., a Qwen-like chat template."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(model_dir / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS_ID]}))


def write_metaspace_tokenizer(model_dir: Path) -> None:
    """A Llama/Jamba/Mistral-style tokenizer.json: every token is a word starting with '▁',
    and the decoder turns '▁' into spaces and strips the one leading space of the text."""
    vocab = {f"\u2581w{i}": i for i in range(256)}
    vocab["<unk>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    tok.save(str(model_dir / "tokenizer.json"))


def write_byte_fallback_tokenizer(model_dir: Path) -> None:
    """Gemma / Llama 2-style byte fallback: ids 0-255 are the byte tokens ``<0x00>``..
    (what the tests' random model samples), the tiny tokenizer's specials at 256-258, then
    a few words past the model's vocabulary. Its decoder (▁ → space, ByteFallback, Fuse)
    turns a run of byte tokens that is no valid UTF-8 into one U+FFFD per token, so a
    longer list can rewrite the text of a shorter one."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for token in [*SPECIALS, "<unk>", "\u2581", "\u2581a", "c", "\u2581hello"]:
        vocab[token] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.add_special_tokens(SPECIALS)
    tok.save(str(model_dir / "tokenizer.json"))


def save_checkpoint(model: Any, model_dir: Path, max_shard_size: str | None = None) -> Path:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(model_dir, **kwargs)
    write_tokenizer(model_dir)
    return model_dir


def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    """[n, vocab] logits of transformers' full forward (explicit positions, no cache)."""
    input_ids = torch.tensor([ids])
    positions = torch.arange(len(ids))[None]
    with torch.no_grad():
        return model(input_ids=input_ids, position_ids=positions, use_cache=False).logits[0]


def hf_greedy(model: Any, ids: list[int], num_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy generate: (new tokens, [num_tokens, vocab] logits), EOS off."""
    # An explicit all-ones mask: without one, generate masks every token equal to
    # pad_token_id (0 here) as padding, and a prompt containing byte 0 goes wrong.
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
            eos_token_id=[],
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(ids) :].tolist()
    return tokens, torch.cat(out.logits, dim=0)

"""The embedded demo model: a tiny Qwen3.5-style checkpoint the project builds for itself.

Real weights cannot be downloaded everywhere, yet a newcomer should see the whole path
(load, plan, serve, chat) work with zero set-up. :func:`build_demo_model` makes a complete
Hugging Face-style checkpoint directory once (about 100 CPU-seconds: a minute or so on two
idle cores) and returns it at once on every later call::

    ~/.cache/hybridkv/demo-qwen35-v1/      ($HYBRIDKV_CACHE_DIR overrides ~/.cache/hybridkv)
        config.json             qwen3_5_text: 3 Gated DeltaNet layers + 1 gated attention layer
        model.safetensors       ~1M fp32 parameters, tied embeddings, our checkpoint names
        tokenizer.json          byte-level BPE (at most 1024 tokens) trained on the corpus
        tokenizer_config.json   chat template <|user|>\\n...<|end|>\\n<|assistant|>\\n, eos <|end|>
        generation_config.json  eos ids: <|end|> (end of turn) and <|endoftext|>
        hybridkv_demo.json      the recipe and its losses; written last, marks the build complete

How it is made: :mod:`hybridkv.demo.corpus` generates ~120 KB of simple stories and chats
from templates (seeded), ``tokenizers`` trains the BPE on it, and the model trains for 200
AdamW steps of 8 x 256 tokens through the serving model code itself
(:mod:`hybridkv.demo.train`). Held-out loss falls from ~6.9 (uniform guessing) to ~0.4: the
model chats in the template's format, tells corpus-style stories, ends its turns with
``<|end|>``, and often picks the wrong fact; it knows nothing beyond the corpus.

The same recipe gives the same weights on the same machine (seeded init, batches and BPE).
A build goes to a temporary sibling directory renamed into place at the end, under a file
lock, so an interrupted or concurrent build never leaves a half directory behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from torch import Tensor

from hybridkv.core.model_config import flatten_text_config, model_spec_from_config
from hybridkv.demo.corpus import Document, documents
from hybridkv.demo.train import evaluate, init_weights, train
from hybridkv.models.base import CausalLM
from hybridkv.models.registry import model_class

DEMO_MODEL_NAME = "demo-qwen35-v1"  # bump the version when the recipe changes: it rebuilds
COMPLETE_MARKER = "hybridkv_demo.json"
CHECKPOINT_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)
EOS_TOKEN, DOC_SEPARATOR = "<|end|>", "<|endoftext|>"
SPECIAL_TOKENS = (DOC_SEPARATOR, "<|system|>", "<|user|>", "<|assistant|>", EOS_TOKEN)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True, kw_only=True)
class DemoRecipe:
    """Everything that determines the demo weights. Changing a default means a new name."""

    seed: int = 0
    corpus_chars: int = 120_000
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4  # full attention every 4th layer, as in Qwen3.5
    num_steps: int = 200
    batch_seqs: int = 8
    seq_tokens: int = 256
    learning_rate: float = 3e-3
    max_position_embeddings: int = 2048

    @property
    def name(self) -> str:
        """Directory name: the default recipe is ``demo-qwen35-v1``; variants say how."""
        changed = {k: v for k, v in asdict(self).items() if v != asdict(DemoRecipe())[k]}
        return DEMO_MODEL_NAME + "".join(f"-{k}{v}" for k, v in sorted(changed.items()))


def default_cache_dir() -> Path:
    """``$HYBRIDKV_CACHE_DIR``, else ``~/.cache/hybridkv``."""
    env = os.environ.get("HYBRIDKV_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hybridkv"


def demo_model_dir(cache_dir: Path | None = None, *, num_steps: int | None = None) -> Path:
    """Where :func:`build_demo_model` puts (or finds) the checkpoint; builds nothing."""
    return (Path(cache_dir) if cache_dir else default_cache_dir()) / _recipe(num_steps).name


def is_complete(model_dir: Path) -> bool:
    """The directory holds a finished build (the marker is written last)."""
    names = (*CHECKPOINT_FILES, COMPLETE_MARKER)
    return all((model_dir / name).is_file() for name in names)


def build_demo_model(
    cache_dir: Path | None = None, *, progress: bool = True, num_steps: int | None = None
) -> Path:
    """The demo checkpoint directory, built on the first call and returned as is afterwards.

    Args:
        cache_dir: parent directory; default :func:`default_cache_dir`.
        progress: show a ``rich`` progress bar (on stderr) while training.
        num_steps: training steps, default the recipe's; another value builds a variant in
            its own directory (tests use a few steps, or 0 for the untrained model).

    Returns:
        ``cache_dir / "demo-qwen35-v1"`` (or the variant's name), loadable by
        :func:`hybridkv.models.loader.load_model`.
    """
    recipe = _recipe(num_steps)
    target = (Path(cache_dir) if cache_dir else default_cache_dir()) / recipe.name
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(target):
        if is_complete(target):  # another process built it while we waited
            return target
        _remove_leftovers(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the checkpoint is an ordinary directory
        try:
            _build_into(tmp, recipe, progress)
            os.rename(tmp, target)  # atomic: the directory appears complete or not at all
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _recipe(num_steps: int | None) -> DemoRecipe:
    if num_steps is None:
        return DemoRecipe()
    if num_steps < 0:
        raise ValueError(f"num_steps must be >= 0, not {num_steps}")
    return replace(DemoRecipe(), num_steps=num_steps)


@contextlib.contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    """An exclusive flock next to the target, so two processes do not build at once."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone keeps the directory whole
        yield
        return
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _remove_leftovers(target: Path) -> None:
    """Under the lock: temp dirs of killed builds, and an incomplete target, go."""
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if target.exists():
        shutil.rmtree(target)


# ---------------------------------------------------------------------- the build


def _build_into(out_dir: Path, recipe: DemoRecipe, progress: bool) -> None:
    start = time.perf_counter()
    train_docs = documents(recipe.seed, recipe.corpus_chars)
    held_out_docs = documents(recipe.seed + 1, 4_000)
    tokenizer = train_tokenizer([render(d) for d in train_docs], recipe.vocab_size)
    config = model_config(recipe, tokenizer)
    spec = model_spec_from_config(
        config, name=recipe.name, kv_dtype="float32", conv_dtype="float32", ssm_dtype="float32"
    )
    model = model_class(spec.model_type)(flatten_text_config(config), spec)
    init_weights(model, recipe.seed)
    stream, doc_starts = _token_stream(tokenizer, train_docs)
    held_out = [_encode(tokenizer, d)[: recipe.seq_tokens] for d in held_out_docs]
    loss_before = evaluate(model, spec, held_out)
    train_losses = train(
        model,
        spec,
        stream,
        doc_starts,
        seed=recipe.seed,
        num_steps=recipe.num_steps,
        batch_seqs=recipe.batch_seqs,
        seq_tokens=recipe.seq_tokens,
        learning_rate=recipe.learning_rate,
        progress=progress,
    )
    summary = {
        "name": recipe.name,
        "recipe": asdict(recipe),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "held_out_loss_before": round(loss_before, 4),
        "held_out_loss_after": round(evaluate(model, spec, held_out), 4),
        "train_loss_last": round(train_losses[-1], 4) if train_losses else None,
        "build_seconds": round(time.perf_counter() - start, 1),
    }
    _write_checkpoint(out_dir, model, tokenizer, config)
    (out_dir / COMPLETE_MARKER).write_text(json.dumps(summary, indent=2) + "\n")


def render(doc: Document) -> str:
    """A document as training text: a story as is, a chat through the chat template."""
    if doc.text is not None:
        return doc.text
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(CHAT_TEMPLATE)
    return template.render(messages=list(doc.messages), add_generation_prompt=False)


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> HFTokenizer:
    """Byte-level BPE: every byte is a token (no unknowns), merges learnt from ``texts``.

    The special tokens come first (ids 0..4); the trainer is deterministic.
    """
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def model_config(recipe: DemoRecipe, tokenizer: HFTokenizer) -> dict[str, Any]:
    """config.json: Qwen3.5 text shapes scaled down (2 KV heads of 32, GDN 2 k / 4 v heads)."""
    num_layers = recipe.num_layers
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "dtype": "float32",
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "hidden_size": recipe.hidden_size,
        "intermediate_size": recipe.intermediate_size,
        "num_hidden_layers": num_layers,
        "layer_types": [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)
        ],
        "full_attention_interval": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "attn_output_gate": True,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
        "max_position_embeddings": recipe.max_position_embeddings,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "eos_token_id": tokenizer.token_to_id(EOS_TOKEN),
        "bos_token_id": None,  # no pad_token_id: transformers would freeze that embedding row
    }


def _encode(tokenizer: HFTokenizer, doc: Document) -> list[int]:
    return tokenizer.encode(render(doc) + DOC_SEPARATOR).ids


def _token_stream(tokenizer: HFTokenizer, docs: Sequence[Document]) -> tuple[Tensor, Tensor]:
    """All documents as one token stream ([N] int64) and the offset of each document."""
    ids: list[int] = []
    starts: list[int] = []
    for doc in docs:
        starts.append(len(ids))
        ids += _encode(tokenizer, doc)
    return torch.tensor(ids), torch.tensor(starts)


# ---------------------------------------------------------------------- files


def _write_checkpoint(
    out_dir: Path, model: CausalLM, tokenizer: HFTokenizer, config: dict[str, Any]
) -> None:
    """The checkpoint files, named as a transformers checkpoint would name them."""
    tensors = {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        if not (config["tie_word_embeddings"] and name == "lm_head.weight")
    }
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save(str(out_dir / "tokenizer.json"))
    eos_ids = [tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(DOC_SEPARATOR)]
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": DOC_SEPARATOR,
        "add_bos_token": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    generation = {"eos_token_id": eos_ids, "pad_token_id": eos_ids[1]}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


__all__ = [
    "DEMO_MODEL_NAME",
    "DemoRecipe",
    "build_demo_model",
    "default_cache_dir",
    "demo_model_dir",
    "is_complete",
]

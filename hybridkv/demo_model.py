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

How it is made: :mod:`hybridkv.demo_corpus` generates ~120 KB of simple stories and chats
from templates (seeded), ``tokenizers`` trains the BPE on it, and the model trains for 200
AdamW steps of 8 x 256 tokens *through the serving model code itself*: the layers of
:class:`hybridkv.models.qwen3_5.Qwen35ForCausalLM` run with autograd over a fresh dense
cache arena per batch (every sequence a fresh request of one prefill chunk), so the weights
are trained by exactly the function that serves them and no second implementation can
drift from it. Its gradients equal transformers' (tests). Held-out loss falls from ~6.9
(uniform guessing) to ~0.4: the model chats in the template's format, tells corpus-style
stories, ends its turns with ``<|end|>``, and often picks the wrong fact; it knows nothing
beyond the corpus.

The same recipe gives the same weights on the same machine (seeded init, batches and BPE).
A build goes to a temporary sibling directory renamed into place at the end, under a file
lock, so an interrupted or concurrent build never leaves a half directory behind.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from jinja2.sandbox import ImmutableSandboxedEnvironment
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from torch import Tensor, nn

from hybridkv.core.layout import ArenaLayout, build_layout
from hybridkv.core.model_config import flatten_text_config, model_spec_from_config
from hybridkv.core.spec import ModelSpec
from hybridkv.demo_corpus import Document, documents
from hybridkv.models.base import CausalLM
from hybridkv.models.batch import ForwardBatch
from hybridkv.models.cache import CacheViews
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
    train_losses = train(model, spec, stream, doc_starts, recipe, progress)
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


def init_weights(model: nn.Module, seed: int) -> None:
    """transformers' Qwen3.5 init from a private generator (global RNG untouched).

    Matrices N(0, 0.02); zero-centred norms 0; GDN ``A_log = log U(1, 16)``, ``dt_bias = 1``;
    the depthwise conv keeps PyTorch's kaiming-uniform bound 1/sqrt(kernel).
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("conv1d.weight"):
                bound = 1.0 / math.sqrt(param.shape[-1])
                param.copy_(torch.rand(param.shape, generator=gen) * 2 * bound - bound)
            elif name.endswith("A_log"):
                param.copy_(torch.log(1 + 15 * torch.rand(param.shape, generator=gen)))
            elif param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
            # 1-d parameters keep their construction values: norms 0 / 1, dt_bias 1


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


# ---------------------------------------------------------------------- training


def dense_batch(spec: ModelSpec, seq_tokens: int, num_seqs: int) -> tuple[ForwardBatch, CacheViews]:
    """A prefill batch of ``num_seqs`` fresh sequences of ``seq_tokens`` and a zeroed arena.

    One page per attention layer holds a whole sequence (block = seq_tokens); every group
    takes whole chunks of the layout, so no two groups' pages share bytes. All rows return
    logits. ``input_ids`` is a placeholder: callers set it per batch.
    """
    probe = build_layout(spec.groups, seq_tokens, 1 << 40)
    num_chunks = {
        g.group_id: -(-num_seqs // probe.pages_per_chunk(g.group_id)) for g in spec.groups
    }
    layout = build_layout(spec.groups, seq_tokens, probe.chunk_bytes * sum(num_chunks.values()))
    pages, first_chunk = {}, 0
    for group in spec.groups:
        gid = group.group_id
        ids = [_page(layout, gid, first_chunk, r) for r in range(num_seqs)]
        pages[gid] = torch.tensor(ids)
        first_chunk += num_chunks[gid]
    batch = ForwardBatch(
        input_ids=torch.zeros(num_seqs * seq_tokens, dtype=torch.int64),
        positions=torch.arange(seq_tokens).repeat(num_seqs),
        query_start_loc=torch.arange(num_seqs + 1) * seq_tokens,
        num_computed_tokens=torch.zeros(num_seqs, dtype=torch.int64),
        block_tables={
            g.group_id: pages[g.group_id][:, None] for g in spec.groups if not g.is_recurrent
        },
        state_pages={g.group_id: pages[g.group_id] for g in spec.groups if g.is_recurrent},
        logits_indices=torch.arange(num_seqs * seq_tokens),
    )
    views = CacheViews(spec, layout, torch.zeros(layout.total_bytes, dtype=torch.uint8))
    return batch, views


def _page(layout: ArenaLayout, group_id: int, first_chunk: int, index: int) -> int:
    per_chunk = layout.pages_per_chunk(group_id)
    return layout.first_page(group_id, first_chunk + index // per_chunk) + index % per_chunk


def train_logits(model: CausalLM, batch: ForwardBatch, views: CacheViews) -> Tensor:
    """``CausalLM.forward`` without its ``no_grad``: [T, vocab] logits with autograd.

    The layers write K/V and states into the arena in place; autograd records those writes
    (the arena is rebuilt for every batch), so the gradients are those of the serving path.
    """
    hidden = model.embed(batch)  # [T, H]
    for layer in model.model.layers:
        hidden = layer(hidden, batch, views)
    return model.compute_logits(model.model.norm(hidden[batch.logits_indices]))


def train(
    model: CausalLM,
    spec: ModelSpec,
    stream: Tensor,
    doc_starts: Tensor,
    recipe: DemoRecipe,
    progress: bool,
) -> list[float]:
    """AdamW with warm-up and cosine decay on windows that start at document starts.

    Returns:
        the training loss of every step.
    """
    gen = torch.Generator().manual_seed(recipe.seed + 2)
    length, rows = recipe.seq_tokens, recipe.batch_seqs
    starts = doc_starts[doc_starts <= stream.numel() - length - 1]
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=recipe.learning_rate, betas=(0.9, 0.95), weight_decay=0.01
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_factor(recipe.num_steps))
    losses: list[float] = []
    model.train()
    with _progress_bar(progress, recipe.num_steps) as advance:
        for _ in range(recipe.num_steps):
            offsets = starts[torch.randint(len(starts), (rows,), generator=gen)]
            window = stream[offsets[:, None] + torch.arange(length + 1)]  # [rows, length + 1]
            batch, views = dense_batch(spec, length, rows)
            batch.input_ids = window[:, :-1].flatten()
            loss = F.cross_entropy(train_logits(model, batch, views), window[:, 1:].flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            advance(losses[-1])
    model.eval()
    return losses


def _lr_factor(num_steps: int) -> Any:
    warmup = max(1, num_steps // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        done = (step - warmup) / max(1, num_steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done))

    return factor


@contextlib.contextmanager
def _progress_bar(enabled: bool, total: int) -> Iterator[Any]:
    """Yields ``advance(loss)``; a rich bar on stderr when enabled, a no-op otherwise."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("building the hybridkv demo model"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), disable=not enabled) as bar:
        task = bar.add_task("train", total=total, loss=float("nan"))
        yield lambda loss: bar.update(task, advance=1, loss=loss)


@torch.no_grad()
def evaluate(model: CausalLM, spec: ModelSpec, sequences: Sequence[Sequence[int]]) -> float:
    """Mean next-token loss over ``sequences``, each a fresh request, through the model."""
    total, count = 0.0, 0
    for ids in sequences:
        batch, views = dense_batch(spec, len(ids) - 1, 1)
        batch.input_ids = torch.tensor(ids[:-1])
        logits = model(batch, views)
        total += float(F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum"))
        count += len(ids) - 1
    return total / count


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

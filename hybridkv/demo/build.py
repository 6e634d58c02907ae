"""The embedded demo model: a tiny Qwen3.5-style checkpoint, shipped in the package.

Real weights cannot be downloaded everywhere, yet a newcomer should see the whole path
(load, plan, serve, chat) work in seconds with zero set-up. So the trained checkpoint ships
as package data, ``hybridkv/demo/checkpoint/``, and this module is its recipe, kept so that
anyone can rebuild it bit for bit::

    python -m hybridkv.demo.build            # rebuild hybridkv/demo/checkpoint/ in place
    python -m hybridkv.demo.build --verify   # rebuild into a temporary directory, compare

    hybridkv/demo/checkpoint/
        config.json             qwen3_5_text: 3 Gated DeltaNet layers + 1 gated attention layer
        model.safetensors       ~1M parameters stored in float16, tied embeddings
        tokenizer.json          byte-level BPE (at most 1024 tokens) trained on the corpus
        tokenizer_config.json   chat template <|user|>\\n...<|end|>\\n<|assistant|>\\n, eos <|end|>
        generation_config.json  eos ids: <|end|> (end of turn) and <|endoftext|>
        hybridkv_demo.json      the recipe, its fingerprint, the losses; written last

How it is made: :mod:`hybridkv.demo.corpus` generates simple stories and chats from
templates (seeded), ``tokenizers`` trains the BPE on it, and the model trains with AdamW
through the serving model code itself (:mod:`hybridkv.demo.train`) on one thread (the
same float sums on every machine, and 20x faster than two threads on a busy one). The
model chats in the template's format, answers the demo script's five questions (v3: the
corpus deals every fact equally often, capitals twice as often as the rest, in chats of up
to five exchanges; v2 answered the capital of France with Berlin), tells corpus-style
stories and ends its turns with ``<|end|>``; it knows nothing beyond the corpus.

The same recipe gives the same weights on the same machine (seeded init, batches and BPE;
one thread; ``--verify`` on the shipped v3 checkpoint: identical). A full rebuild (900
steps) took 20 min 25 s wall, 474 s of CPU, on the shared 2-core machine under load ~7, so
the test suite checks a cheap fingerprint instead: the corpus and the tokenizer exactly, and
the weights after the first :data:`FINGERPRINT_STEPS` steps of the recipe's own schedule
against the figures the full build recorded at that step (:func:`recipe_fingerprint`). Variants
(another ``num_steps``) build into a directory of their own, under a file lock, renamed
into place when complete.
"""

from __future__ import annotations

import argparse
import contextlib
import filecmp
import hashlib
import json
import os
import shutil
import sys
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
from hybridkv.core.spec import ModelSpec
from hybridkv.demo import CHECKPOINT_FILES, COMPLETE_MARKER, SHIPPED_DIR, is_complete
from hybridkv.demo.corpus import Document, documents
from hybridkv.demo.train import evaluate, init_weights, train
from hybridkv.forward.views import TORCH_DTYPES
from hybridkv.models.base import CausalLM
from hybridkv.models.registry import model_class

DEMO_MODEL_NAME = "demo-qwen35-v3"  # bump the version when the recipe changes
FINGERPRINT_STEPS = 2  # the recipe's first steps, recorded by the full build, checked by tests
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
    corpus_chars: int = 200_000
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4  # full attention every 4th layer, as in Qwen3.5
    num_steps: int = 900
    batch_seqs: int = 8
    seq_tokens: int = 256
    learning_rate: float = 3e-3
    max_position_embeddings: int = 2048
    storage_dtype: str = "float16"  # half the bytes of fp32; the trained weights fit its range

    @property
    def name(self) -> str:
        """Directory name: the default recipe is :data:`DEMO_MODEL_NAME`; variants say how."""
        changed = {k: v for k, v in asdict(self).items() if v != asdict(DemoRecipe())[k]}
        return DEMO_MODEL_NAME + "".join(f"-{k}{v}" for k, v in sorted(changed.items()))


def demo_model_dir(parent: Path, *, num_steps: int | None = None) -> Path:
    """Where :func:`build_demo_model` puts (or finds) a variant; builds nothing."""
    return Path(parent) / _recipe(num_steps).name


def build_demo_model(parent: Path, *, progress: bool = True, num_steps: int | None = None) -> Path:
    """A variant of the demo checkpoint built in ``parent`` (returned as is once complete).

    The shipped checkpoint is :data:`hybridkv.demo.SHIPPED_DIR`; this builds others (tests
    use 0-2 steps) and, through :func:`main`, the shipped one.

    Args:
        parent: the directory that receives ``<recipe name>/``.
        progress: show a ``rich`` progress bar (on stderr) while training.
        num_steps: training steps, default the recipe's.

    Returns:
        ``parent / recipe.name``, loadable by :func:`hybridkv.models.loader.load_model`.
    """
    recipe = _recipe(num_steps)
    target = Path(parent) / recipe.name
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(target):
        if is_complete(target):  # another process built it while we waited
            return target
        _remove_leftovers(target)
        _build_atomically(target, recipe, progress)
    return target


def _build_atomically(target: Path, recipe: DemoRecipe, progress: bool) -> None:
    """Build in a temporary sibling, then rename it to ``target`` (all or nothing)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the checkpoint is an ordinary directory
    try:
        with single_threaded():
            _build_into(tmp, recipe, progress)
        os.rename(tmp, target)  # atomic: the directory appears complete or not at all
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _recipe(num_steps: int | None) -> DemoRecipe:
    if num_steps is None:
        return DemoRecipe()
    if num_steps < 0:
        raise ValueError(f"num_steps must be >= 0, not {num_steps}")
    return replace(DemoRecipe(), num_steps=num_steps)


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """torch on one thread while building: the same float sums on every machine, and fast.

    Tiny matrices gain nothing from a second thread, and on a busy machine OpenMP's barriers
    made a training step 20x slower (34 s against 1.8 s measured under load 12 on 2 cores).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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


@dataclass(frozen=True)
class _Inputs:
    """What the recipe trains on, before any training: documents, tokenizer, fresh model."""

    train_docs: list[Document]
    tokenizer: HFTokenizer
    config: dict[str, Any]
    spec: ModelSpec
    model: CausalLM


def _inputs(recipe: DemoRecipe) -> _Inputs:
    train_docs = documents(recipe.seed, recipe.corpus_chars)
    tokenizer = train_tokenizer([render(d) for d in train_docs], recipe.vocab_size)
    config = model_config(recipe, tokenizer)
    spec = model_spec_from_config(
        config, name=recipe.name, kv_dtype="float32", conv_dtype="float32", ssm_dtype="float32"
    )
    model = model_class(spec.model_type)(flatten_text_config(config), spec)
    init_weights(model, recipe.seed)
    return _Inputs(train_docs, tokenizer, config, spec, model)


def _train(
    recipe: DemoRecipe, inputs: _Inputs, progress: bool, stop_after: int | None, on_step: Any
) -> list[float]:
    stream, doc_starts = _token_stream(inputs.tokenizer, inputs.train_docs)
    return train(
        inputs.model,
        inputs.spec,
        stream,
        doc_starts,
        seed=recipe.seed,
        num_steps=recipe.num_steps,
        batch_seqs=recipe.batch_seqs,
        seq_tokens=recipe.seq_tokens,
        learning_rate=recipe.learning_rate,
        progress=progress,
        stop_after=stop_after,
        on_step=on_step,
    )


def _sha256(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def weight_figures(model: CausalLM) -> dict[str, list[float]]:
    """Per tensor: the sum and the sum of absolute values, in float64 (a weight fingerprint
    that tolerates a different float summation order, unlike a hash)."""
    return {
        name: [float(p.double().sum()), float(p.double().abs().sum())]
        for name, p in model.state_dict().items()
    }


def _fingerprint(inputs: _Inputs, weights: dict[str, list[float]]) -> dict[str, Any]:
    corpus = "\n".join(render(d) for d in inputs.train_docs)
    return {
        "steps": FINGERPRINT_STEPS,
        "corpus_sha256": _sha256(corpus),
        "tokenizer_sha256": _sha256(inputs.tokenizer.to_str()),
        "weights": weights,
    }


def recipe_fingerprint(recipe: DemoRecipe | None = None) -> dict[str, Any]:
    """The cheap fingerprint of ``recipe`` (default: the shipped one): the corpus and
    tokenizer hashes and the weights after its first :data:`FINGERPRINT_STEPS` steps.

    A few seconds of CPU; the full build records the same figures at the same step, in
    ``hybridkv_demo.json``, so a recipe edit without a rebuild shows as a mismatch.
    """
    recipe = recipe or DemoRecipe()
    with single_threaded():
        inputs = _inputs(recipe)
        _train(recipe, inputs, False, FINGERPRINT_STEPS, None)
    return _fingerprint(inputs, weight_figures(inputs.model))


def _build_into(out_dir: Path, recipe: DemoRecipe, progress: bool) -> None:
    start = time.perf_counter()
    inputs = _inputs(recipe)
    held_out_docs = documents(recipe.seed + 1, 4_000)
    held_out = [_encode(inputs.tokenizer, d)[: recipe.seq_tokens] for d in held_out_docs]
    loss_before = evaluate(inputs.model, inputs.spec, held_out)
    early: dict[str, list[float]] = {}

    def record(step: int) -> None:
        if step == FINGERPRINT_STEPS:
            early.update(weight_figures(inputs.model))

    train_losses = _train(recipe, inputs, progress, None, record)
    summary = {
        "name": recipe.name,
        "recipe": asdict(recipe),
        "num_parameters": sum(p.numel() for p in inputs.model.parameters()),
        "held_out_loss_before": round(loss_before, 4),
        "held_out_loss_after": round(evaluate(inputs.model, inputs.spec, held_out), 4),
        "train_loss_last": round(train_losses[-1], 4) if train_losses else None,
        "build_seconds": round(time.perf_counter() - start, 1),
        "torch": torch.__version__,
        "fingerprint": _fingerprint(inputs, early) if early else None,
    }
    _write_checkpoint(out_dir, inputs.model, inputs.tokenizer, inputs.config, recipe)
    summary["model_sha256"] = _sha256((out_dir / "model.safetensors").read_bytes())
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
    out_dir: Path,
    model: CausalLM,
    tokenizer: HFTokenizer,
    config: dict[str, Any],
    recipe: DemoRecipe,
) -> None:
    """The checkpoint files, named as a transformers checkpoint would name them.

    Weights are stored in ``recipe.storage_dtype`` and config.json says so (transformers
    and this loader cast them to the dtype asked for at load).
    """
    dtype = TORCH_DTYPES[recipe.storage_dtype]
    tensors = {
        name: tensor.detach().to(dtype).contiguous()
        for name, tensor in model.state_dict().items()
        if not (config["tie_word_embeddings"] and name == "lm_head.weight")
    }
    config = config | {"dtype": recipe.storage_dtype}
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


# ---------------------------------------------------------------------- rebuilding


def rebuild(out_dir: Path, progress: bool = True) -> Path:
    """Build the default recipe into ``out_dir`` (replaced when complete)."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(out_dir):
        _remove_leftovers(out_dir)
        _build_atomically(out_dir, DemoRecipe(), progress)
    return out_dir


def differing_files(built: Path, shipped: Path = SHIPPED_DIR) -> list[str]:
    """Checkpoint files whose bytes differ between two builds (the timing in the marker
    aside: only its recipe, fingerprint and model hash are compared)."""
    names = [n for n in CHECKPOINT_FILES if not filecmp.cmp(built / n, shipped / n, shallow=False)]
    keys = ("recipe", "fingerprint", "model_sha256")
    ours, theirs = (json.loads((d / COMPLETE_MARKER).read_text()) for d in (built, shipped))
    if any(ours.get(k) != theirs.get(k) for k in keys):
        names.append(COMPLETE_MARKER)
    return names


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hybridkv.demo.build [--out DIR] [--verify]``."""
    parser = argparse.ArgumentParser(prog="python -m hybridkv.demo.build", description=__doc__)
    parser.add_argument("--out", type=Path, default=SHIPPED_DIR, help="default: the package's")
    parser.add_argument(
        "--verify", action="store_true", help="build in a temporary directory and compare"
    )
    args = parser.parse_args(argv)
    if not args.verify:
        print(f"built {rebuild(args.out)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        differ = differing_files(rebuild(Path(tmp) / "checkpoint"), args.out)
    print("identical" if not differ else f"differ: {', '.join(differ)}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "DEMO_MODEL_NAME",
    "FINGERPRINT_STEPS",
    "DemoRecipe",
    "build_demo_model",
    "demo_model_dir",
    "differing_files",
    "rebuild",
    "recipe_fingerprint",
    "weight_figures",
]

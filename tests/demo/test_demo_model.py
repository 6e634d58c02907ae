"""The embedded demo model: built once and atomically, loadable, chat-ready, and trained.

The default recipe is built once per module (about a minute on two idle cores); the build
mechanics use variants of 0-2 steps, which land in their own directories.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import hybridkv.demo.build as demo
import hybridkv.demo.train as demo_train
from hybridkv.demo.build import (
    CHAT_TEMPLATE,
    COMPLETE_MARKER,
    DEMO_MODEL_NAME,
    build_demo_model,
    demo_model_dir,
    is_complete,
)
from hybridkv.demo.corpus import documents
from hybridkv.models.loader import LoadedModel, load_model
from tests.models.paged_runner import PagedRunner


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("cache"), progress=False)


@pytest.fixture(scope="module")
def untrained_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("cache0"), progress=False, num_steps=0)


@pytest.fixture(scope="module")
def trained(trained_dir: Path) -> LoadedModel:
    return load_model(trained_dir, "float32")


def held_out_loss(lm: LoadedModel, num_docs: int = 12) -> float:
    """Mean next-token loss on unseen samples, each prefilled through the paged runner."""
    assert lm.tokenizer is not None
    runner = PagedRunner(lm.model, lm.spec)
    total, count = 0.0, 0
    for i, doc in enumerate(documents(seed=1234, num_chars=3_000)[:num_docs]):
        ids = lm.tokenizer.encode(demo.render(doc))[:200]
        logits = runner.prefill_chunks(f"doc{i}", ids[:-1], [64])
        total += float(F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum"))
        count += len(ids) - 1
    return total / count


def greedy_reply(lm: LoadedModel, question: str, max_tokens: int = 48) -> tuple[str, bool]:
    """(reply text, whether it ended with an EOS id) for one user turn."""
    assert lm.tokenizer is not None
    prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    assert isinstance(prompt, str)
    ids = lm.tokenizer.encode(prompt, add_special_tokens=False)
    tokens, _ = PagedRunner(lm.model, lm.spec).greedy("chat", ids, max_tokens)
    eos = set(lm.tokenizer.eos_token_ids)
    end = next((i for i, t in enumerate(tokens) if t in eos), None)
    return lm.tokenizer.decode(tokens[:end]), end is not None


# ---------------------------------------------------------------------- building


def test_second_call_returns_the_directory_without_rebuilding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = build_demo_model(tmp_path, progress=False, num_steps=2)
    assert (
        path == tmp_path / f"{DEMO_MODEL_NAME}-num_steps2" == demo_model_dir(tmp_path, num_steps=2)
    )
    assert is_complete(path)
    mtime = (path / "model.safetensors").stat().st_mtime_ns

    def no_rebuild(*args: object) -> None:
        raise AssertionError("rebuilt a complete directory")

    monkeypatch.setattr(demo, "_build_into", no_rebuild)
    assert build_demo_model(tmp_path, progress=False, num_steps=2) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{path.name}.lock", path.name]


def test_interrupted_build_leaves_no_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(out_dir: Path, *args: object) -> None:
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(demo, "_write_checkpoint", interrupted)
        with pytest.raises(KeyboardInterrupt):
            build_demo_model(tmp_path, progress=False, num_steps=0)
    assert [p.name for p in tmp_path.iterdir()] == [f".{DEMO_MODEL_NAME}-num_steps0.lock"]
    (tmp_path / f".{DEMO_MODEL_NAME}-num_steps0.tmp-killed").mkdir()  # a kill -9 leftover
    path = build_demo_model(tmp_path, progress=False, num_steps=0)
    assert is_complete(path)
    assert not list(tmp_path.glob("*.tmp-*"))


def test_default_cache_dir_follows_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(tmp_path))
    assert demo_model_dir() == tmp_path / DEMO_MODEL_NAME
    monkeypatch.delenv("HYBRIDKV_CACHE_DIR")
    assert demo_model_dir() == Path.home() / ".cache" / "hybridkv" / DEMO_MODEL_NAME


def test_tokenizer_training_is_deterministic() -> None:
    texts = [demo.render(d) for d in documents(seed=3, num_chars=8_000)]
    first = demo.train_tokenizer(texts, 400).to_str()
    assert demo.train_tokenizer(texts, 400).to_str() == first


# ---------------------------------------------------------------------- the checkpoint


def test_checkpoint_loads_as_a_small_qwen35_hybrid(trained: LoadedModel) -> None:
    assert trained.spec.model_type == "qwen3_5_text"
    assert (trained.spec.num_recurrent_layers, trained.spec.num_attention_layers) == (3, 1)
    num_params = sum(p.numel() for p in trained.model.parameters())
    assert 500_000 < num_params < 3_000_000
    assert trained.tokenizer is not None
    assert trained.tokenizer.vocab_size == trained.config["vocab_size"] <= 1024


def test_tokenizer_round_trips_and_keeps_special_tokens_whole(trained: LoadedModel) -> None:
    tok = trained.tokenizer
    assert tok is not None
    for text in ["Once upon a time, a cat sat.", "héllo wörld 🙂 \t 12+3=15\n", ""]:
        assert tok.decode(tok.encode(text)) == text
    ids = tok.encode("<|user|>\nHi<|end|>")
    assert ids[0] == tok.backend.token_to_id("<|user|>")
    assert ids[-1] == tok.backend.token_to_id("<|end|>")
    assert tok.decode(ids) == "\nHi"


def test_chat_template_and_eos(trained: LoadedModel) -> None:
    tok = trained.tokenizer
    assert tok is not None and tok.chat_template == CHAT_TEMPLATE
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello!"},
    ]
    expected = "<|system|>\nBe brief.<|end|>\n<|user|>\nHello!<|end|>\n<|assistant|>\n"
    assert tok.apply_chat_template(messages) == expected
    with pytest.raises(Exception, match="unknown role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
    end_id = tok.backend.token_to_id("<|end|>")
    assert tok.eos_token == "<|end|>"
    assert tok.eos_token_ids[0] == end_id
    assert trained.config["eos_token_id"] == end_id


# ---------------------------------------------------------------------- training


@pytest.mark.slow
def test_training_lowers_held_out_loss(
    trained_dir: Path, trained: LoadedModel, untrained_dir: Path
) -> None:
    before = held_out_loss(load_model(untrained_dir, "float32"))
    after = held_out_loss(trained)
    assert before > 6.0  # about ln(1024): the untrained model guesses
    assert after < 1.5, (before, after)
    summary = json.loads((trained_dir / COMPLETE_MARKER).read_text())
    assert summary["held_out_loss_after"] < summary["held_out_loss_before"] - 4


@pytest.mark.slow
def test_greedy_chat_reply_is_corpus_like_text(trained: LoadedModel) -> None:
    reply, ended = greedy_reply(trained, "What color is the grass?")
    allowed = set(string.ascii_letters + string.digits + " .,!?'\"\n")
    assert ended, reply
    assert sum(c in allowed for c in reply) >= 0.95 * len(reply) > 0, reply


def test_training_gradients_equal_transformers(untrained_dir: Path) -> None:
    """The training forward (our serving layers with autograd) has transformers' gradients."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(untrained_dir, dtype=torch.float32)
    ours = load_model(untrained_dir, "float32")
    ids = torch.randint(
        0, ours.config["vocab_size"], (2, 97), generator=torch.Generator().manual_seed(0)
    )
    batch, views = demo_train.dense_batch(ours.spec, 96, 2)
    batch.input_ids = ids[:, :-1].flatten()
    loss = F.cross_entropy(demo_train.train_logits(ours.model, batch, views), ids[:, 1:].flatten())
    loss.backward()
    hf_logits = hf(input_ids=ids[:, :-1], use_cache=False).logits
    hf_loss = F.cross_entropy(hf_logits.flatten(0, 1), ids[:, 1:].flatten())
    hf_loss.backward()
    torch.testing.assert_close(loss, hf_loss)
    hf_params = dict(hf.named_parameters())
    for name, param in ours.model.named_parameters():
        assert param.grad is not None, name
        ref = hf_params[name].grad
        torch.testing.assert_close(param.grad, ref, atol=1e-3 * float(ref.abs().max()), rtol=0)

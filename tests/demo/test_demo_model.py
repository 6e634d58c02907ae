"""The demo model shipped in the package: complete, what its recipe makes, chat-ready, and
answering the demo script; the recipe's build mechanics on cheap variants.

The suite never trains the full model (tens of CPU-minutes): the shipped files are tied to
the recipe by the corpus and tokenizer hashes, the config, and the weights after the
recipe's first steps (``recipe_fingerprint``), which the full build recorded.
``python -m hybridkv.demo.build --verify`` is the full, bit-for-bit check.
"""

from __future__ import annotations

import fnmatch
import hashlib
import itertools
import json
import re
import string
import tomllib
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from tokenizers import Tokenizer as HFTokenizer

import hybridkv.demo.build as demo
import hybridkv.demo.train as demo_train
from hybridkv import LLM, SamplingParams
from hybridkv.cli import main
from hybridkv.cli.demo import SCRIPT, SYSTEM_PROMPT
from hybridkv.demo import COMPLETE_MARKER, SHIPPED_DIR, is_complete, shipped_demo_dir
from hybridkv.demo.build import (
    CHAT_TEMPLATE,
    DEMO_MODEL_NAME,
    DemoRecipe,
    build_demo_model,
    demo_model_dir,
)
from hybridkv.demo.corpus import CAPITALS, COLORS, OPPOSITES, documents
from hybridkv.models.loader import LoadedModel, load_model
from tests.models.paged_runner import PagedRunner

# The demo script's answers, as the corpus states them.
EXPECTED_REPLIES = {
    "What color is the sky?": ["The sky is blue."],
    "What does a cow say?": ['A cow says "moo".'],
    "What is the capital of France?": ["The capital of France is Paris."],
    "Hello!": ["Hello! How can I help you today?", "Hi! What would you like to talk about?"],
    "Thank you!": ["You are welcome!", "Happy to help."],
}


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def metadata() -> dict:
    return json.loads((SHIPPED_DIR / COMPLETE_MARKER).read_text())


@pytest.fixture(scope="module")
def untrained_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("cache0"), progress=False, num_steps=0)


@pytest.fixture(scope="module")
def trained() -> LoadedModel:
    return load_model(shipped_demo_dir(), "float32")


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


# ---------------------------------------------------------------------- the shipped files


def test_shipped_checkpoint_is_complete_small_and_half_precision(metadata: dict) -> None:
    assert is_complete(SHIPPED_DIR)
    assert metadata["recipe"] == asdict(DemoRecipe()) and metadata["name"] == DEMO_MODEL_NAME
    weights = SHIPPED_DIR / "model.safetensors"
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == metadata["model_sha256"]
    assert weights.stat().st_size < 3 << 20  # ~1M parameters in float16
    with safe_open(str(weights), framework="pt") as f:
        assert {f.get_slice(n).get_dtype() for n in f.keys()} == {"F16"}  # noqa: SIM118
    assert json.loads((SHIPPED_DIR / "config.json").read_text())["dtype"] == "float16"


def test_shipped_checkpoint_is_declared_package_data() -> None:
    """A wheel carries every file of the checkpoint (pyproject's package-data globs)."""
    pyproject = tomllib.loads((SHIPPED_DIR.parents[2] / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["hybridkv.demo"]
    for path in SHIPPED_DIR.iterdir():
        assert any(fnmatch.fnmatch(f"checkpoint/{path.name}", g) for g in globs), path.name


def test_shipped_files_are_what_the_recipe_makes(metadata: dict) -> None:
    """Corpus and tokenizer exactly, the config, and the weights after the recipe's first
    steps against the figures the full build recorded at that step."""
    shipped = metadata["fingerprint"]
    fresh = demo.recipe_fingerprint()
    assert fresh["steps"] == shipped["steps"] == demo.FINGERPRINT_STEPS
    assert fresh["corpus_sha256"] == shipped["corpus_sha256"]
    assert fresh["tokenizer_sha256"] == shipped["tokenizer_sha256"]
    tokenizer = HFTokenizer.from_file(str(SHIPPED_DIR / "tokenizer.json"))
    assert hashlib.sha256(tokenizer.to_str().encode()).hexdigest() == shipped["tokenizer_sha256"]
    config = demo.model_config(DemoRecipe(), tokenizer) | {"dtype": DemoRecipe().storage_dtype}
    assert json.loads((SHIPPED_DIR / "config.json").read_text()) == config
    assert fresh["weights"].keys() == shipped["weights"].keys()
    for name, (total, magnitude) in shipped["weights"].items():
        got_total, got_magnitude = fresh["weights"][name]
        assert got_magnitude == pytest.approx(magnitude, rel=1e-5, abs=1e-6), name
        assert got_total == pytest.approx(total, rel=1e-4, abs=1e-3 * magnitude / 100), name


@pytest.fixture(scope="module")
def script_replies() -> dict[str, tuple[str, str | None]]:
    """The shipped model's greedy reply and finish reason to each question of the script,
    asked in one conversation as ``hybridkv demo`` asks them."""
    llm = LLM(str(shipped_demo_dir()), cache_memory_gib=0.05)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    replies = {}
    for question in SCRIPT:
        messages.append({"role": "user", "content": question})
        (out,) = llm.chat(messages, SamplingParams(max_tokens=48, temperature=0), use_tqdm=False)
        replies[question] = (out.outputs[0].text, out.outputs[0].finish_reason)
        messages.append({"role": "assistant", "content": out.outputs[0].text})
    return replies


@pytest.mark.parametrize("question", SCRIPT)
def test_shipped_model_answers_the_demo_script(
    script_replies: dict[str, tuple[str, str | None]], question: str
) -> None:
    reply, finish_reason = script_replies[question]
    assert finish_reason == "stop", (question, reply)
    assert reply in EXPECTED_REPLIES[question], (question, reply)


def test_hybridkv_demo_shows_capacity_cache_reuse_and_ttft(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--cache-memory-gib", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "KV capacity (attention groups only)" in out and "unified page size" in out
    assert "max concurrency at max_model_len" in out and "hybridkv plan" in out
    turns = [line for line in out.splitlines() if "from the prefix cache" in line]
    assert len(turns) == len(SCRIPT)
    cached = [int(line.split(", ")[1].split()[0]) for line in turns]
    assert cached[0] == 0 and all(a < b for a, b in itertools.pairwise(cached))
    timings = [line for line in out.splitlines() if "first token after" in line]
    assert len(timings) == len(SCRIPT)
    for line in timings:
        assert "with caching" in line and "without (same reply)" in line, line
        assert "medians of 3 interleaved runs, each from the same cache state" in line, line
    for question, replies in EXPECTED_REPLIES.items():
        assert any(r in out for r in replies), question


def test_hybridkv_demo_times_each_turn_from_the_same_cache_state(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Caching on and off are timed on equal terms: both engines get the same warm-up;
    each turn's first token is timed --repeats times on each, interleaved, and before each
    caching-on run the cache is reset and the previous turn replayed, so every run finds
    the cache as the turn did (the same cached prefix); the real turn then runs from that
    state too, and the running totals count the scripted turns only."""
    import hybridkv.cli.demo as demo_cli
    from hybridkv.engine import LLMEngine

    calls: list[tuple] = []
    reply, reset = demo_cli._reply, LLMEngine.reset_prefix_cache

    def recording(engine, prompt, params, stream=True):  # type: ignore[no-untyped-def]
        ids = tuple(prompt["prompt_token_ids"])
        calls.append(("reply", engine.config.enable_prefix_caching, params.max_tokens, ids))
        return reply(engine, prompt, params, stream)

    def recording_reset(engine: LLMEngine) -> bool:
        assert engine.config.enable_prefix_caching
        calls.append(("reset",))
        return reset(engine)

    monkeypatch.setattr(demo_cli, "_reply", recording)
    monkeypatch.setattr(LLMEngine, "reset_prefix_cache", recording_reset)
    argv = ["demo", "--cache-memory-gib", "0.05", "--max-tokens", "4", "--repeats", "2"]
    assert main(argv) == 0
    warm_ups, turns = calls[:2], calls[2:]
    assert {caching for _, caching, _, _ in warm_ups} == {True, False}
    assert warm_ups[0][2:] == warm_ups[1][2:] and warm_ups[0][2] == 1  # the same warm-up
    prompts = list(dict.fromkeys(c[3] for c in turns if c[0] == "reply" and c[2] == 1))
    assert len(prompts) == len(SCRIPT)
    expected: list[tuple] = []
    for k, prompt in enumerate(prompts):
        replay = [("reset",)] + ([("reply", True, 4, prompts[k - 1])] if k else [])
        timed = [("reply", True, 1, prompt), ("reply", False, 1, prompt)]
        expected += (replay + timed) * 2 + replay
        expected += [("reply", True, 4, prompt), ("reply", False, 4, prompt)]
    assert turns == expected
    out = capsys.readouterr().out
    timings = [line for line in out.splitlines() if "first token after" in line]
    assert len(timings) == len(SCRIPT)
    assert all(
        "medians of 2 interleaved runs, each from the same cache state" in t for t in timings
    )
    first = next(line for line in out.splitlines() if "all turns:" in line)
    assert f"all turns: 0/{len(prompts[0])} prompt tokens hit" in first, first


# ---------------------------------------------------------------------- building variants


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


def test_corpus_asks_every_fact_equally_often() -> None:
    """Fact tables are dealt like cards (v2 drew them independently: Germany's capital was
    asked 12 times, France's 8, and the model answered France with Berlin)."""
    asked: dict[str, list[str]] = {"capital": [], "color": [], "opposite": []}
    patterns = {
        "capital": r"What is the capital of (\w+)\?",
        "color": r"What color is the (\w+)\?",
        "opposite": r"What is the opposite of (\w+)\?",
    }
    for doc in documents(DemoRecipe().seed, DemoRecipe().corpus_chars):
        for message in doc.messages:
            for kind, pattern in patterns.items():
                if message["role"] == "user" and (m := re.fullmatch(pattern, message["content"])):
                    asked[kind].append(m[1])
    tables = {"capital": CAPITALS, "color": COLORS, "opposite": OPPOSITES}
    for kind, table in tables.items():
        counts = Counter(asked[kind])
        assert counts.keys() == table.keys(), kind
        assert max(counts.values()) - min(counts.values()) <= 1, (kind, counts)
    assert len(asked["capital"]) > 1.5 * len(asked["color"])  # capitals dealt twice as often
    assert max(len(d.messages) for d in documents(0, 20_000)) >= 10  # five-exchange chats


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


def test_training_lowers_held_out_loss(
    metadata: dict, trained: LoadedModel, untrained_dir: Path
) -> None:
    before = held_out_loss(load_model(untrained_dir, "float32"))
    after = held_out_loss(trained)
    assert before > 6.0  # about ln(1024): the untrained model guesses
    assert after < 1.0, (before, after)
    assert metadata["held_out_loss_after"] < metadata["held_out_loss_before"] - 5


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

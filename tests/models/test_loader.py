"""load_model: single and sharded safetensors, tied embeddings, VLM-nested Qwen3.5, dtypes."""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from pathlib import Path

import pytest
import torch
from paged_runner import PagedRunner
from safetensors.torch import load_file, save_file
from tiny import EOS_ID, hf_logits, make_hf_model, save_checkpoint

from hybridkv.layers.fp32_matmul import Fp32Embedding, Fp32Linear, upcast_extra_bytes
from hybridkv.layers.moe import GroupedExperts
from hybridkv.models import loader
from hybridkv.models.loader import load_model
from hybridkv.ops.cpu_gemm import native_gemm

IDS = list(range(3, 40))


def run(lm) -> torch.Tensor:
    return PagedRunner(lm.model, lm.spec).step([("a", IDS)], all_logits=True)


def test_sharded_checkpoint(tmp_path: Path) -> None:
    hf = make_hf_model("qwen3_next")
    save_checkpoint(hf, tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    got = run(load_model(tmp_path, "float32"))
    assert float((got - hf_logits(hf, IDS)).abs().max()) < 1e-4


def test_tied_embeddings_have_no_lm_head_on_disk(tmp_path: Path) -> None:
    hf = make_hf_model("qwen3_5_text", tie_word_embeddings=True)
    save_checkpoint(hf, tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    lm = load_model(tmp_path, "float32")
    assert lm.model.lm_head.weight is lm.model.model.embed_tokens.weight
    assert float((run(lm) - hf_logits(hf, IDS)).abs().max()) < 1e-4


def nest_as_vlm(text_dir: Path, vlm_dir: Path) -> None:
    """Rewrite a text checkpoint the way real Qwen3.5 ships: VLM config, language_model.*."""
    text_cfg = json.loads((text_dir / "config.json").read_text())
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text_cfg,
        "vision_config": {"model_type": "qwen3_5", "depth": 1, "hidden_size": 8},
        "tie_word_embeddings": False,
    }
    vlm_dir.mkdir()
    (vlm_dir / "config.json").write_text(json.dumps(config))
    tensors = {}
    for name, tensor in load_file(text_dir / "model.safetensors").items():
        tensors[name.replace("model.", "model.language_model.", 1)] = tensor
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(24, 8)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, vlm_dir / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (vlm_dir / name).write_bytes((text_dir / name).read_bytes())


def test_vlm_nested_qwen3_5(tmp_path: Path) -> None:
    hf = make_hf_model("qwen3_5_text")
    save_checkpoint(hf, tmp_path / "text")
    nest_as_vlm(tmp_path / "text", tmp_path / "vlm")
    lm = load_model(tmp_path / "vlm", "float32")
    assert lm.spec.model_type == "qwen3_5_text"
    assert lm.config["wrapper_model_type"] == "qwen3_5"
    assert float((run(lm) - hf_logits(hf, IDS)).abs().max()) < 1e-4
    assert lm.tokenizer is not None and lm.tokenizer.eos_token_ids == [EOS_ID]


def test_fp32_model_keeps_every_cache_tensor_fp32(get_tiny) -> None:
    _, lm = get_tiny("qwen3_5_text")
    dtypes = {t.dtype for c in lm.spec.layers for t in getattr(c.spec, "tensors", ())}
    assert dtypes == {"float32"} and lm.spec.dtype == "float32"


def test_bfloat16_load_matches_transformers_in_bfloat16(tmp_path: Path, get_tiny) -> None:
    """bf16 ours vs bf16 transformers: a few bf16 ulps (HF bf16 vs fp32 itself differs ~0.7)."""
    hf, _ = get_tiny("qwen3_next")
    lm16 = load_model(save_checkpoint(hf, tmp_path), "bfloat16")
    assert lm16.spec.dtype == "bfloat16"
    state = [t for c in lm16.spec.layers for t in getattr(c.spec, "tensors", ())]
    assert {t.dtype for t in state} == {"bfloat16"}  # no mamba_ssm_dtype: ssm follows the model
    assert next(lm16.model.parameters()).dtype == torch.bfloat16
    ref = hf_logits(copy.deepcopy(hf).to(torch.bfloat16), IDS).float()
    diff = (run(lm16) - ref).abs()
    assert float(diff.max()) < 0.15 and float(diff.mean()) < 0.02


def test_fp32_matmuls_of_a_bfloat16_model_match_transformers_in_bfloat16(
    tmp_path: Path, get_tiny
) -> None:
    """``matmul_dtype="float32"``: every untied linear and the stacked experts hold fp32
    weights, the model, its caches and its logits stay bf16's, as close to bf16
    transformers as the bf16 load (test above)."""
    hf, _ = get_tiny("qwen3_next")  # dense and MoE layers
    lm = load_model(save_checkpoint(hf, tmp_path), "bfloat16", matmul_dtype="float32")
    assert lm.spec.dtype == "bfloat16"
    linears = [m for m in lm.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.dtype == torch.float32 for m in linears)
    assert any(isinstance(m, Fp32Linear) for m in lm.model.modules())
    experts = [m for m in lm.model.modules() if isinstance(m, GroupedExperts)]
    assert experts and all(m.matmul_dtype == torch.float32 for m in experts)
    assert lm.model.model.embed_tokens.weight.dtype == torch.bfloat16
    ref = hf_logits(copy.deepcopy(hf).to(torch.bfloat16), IDS).float()
    diff = (run(lm) - ref).abs()
    assert float(diff.max()) < 0.15 and float(diff.mean()) < 0.02


def test_fp32_matmuls_of_a_tied_bfloat16_model_share_one_table(tmp_path: Path) -> None:
    """A tied LM head multiplies in fp32 from the same fp32 table the embedding reads its
    (exact bf16) rows from; the logits stay as close to bf16 transformers'."""
    hf = make_hf_model("qwen3_5_text", tie_word_embeddings=True)
    lm = load_model(save_checkpoint(hf, tmp_path), "bfloat16", matmul_dtype="float32")
    head, embedding = lm.model.lm_head, lm.model.model.embed_tokens
    assert isinstance(head, Fp32Linear) and isinstance(embedding, Fp32Embedding)
    assert head.inner.weight is embedding.weight and embedding.weight.dtype == torch.float32
    ref = hf_logits(copy.deepcopy(hf).to(torch.bfloat16), IDS).float()
    diff = (run(lm) - ref).abs()
    assert float(diff.max()) < 0.15 and float(diff.mean()) < 0.02


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matmul_dtype_auto_upcasts_only_an_emulated_dtype(
    dtype: str, tmp_path: Path, get_tiny
) -> None:
    """ "auto" converts a bf16 model's weights where this CPU emulates bf16 matmuls, never
    an fp32 model's; "model" never converts; anything else is refused."""
    hf, _ = get_tiny("qwen3_5_text")
    path = save_checkpoint(hf, tmp_path)

    def converted(matmul_dtype: str) -> bool:
        lm = load_model(path, dtype, matmul_dtype=matmul_dtype)
        return any(isinstance(m, Fp32Linear) for m in lm.model.modules())

    emulated = dtype == "bfloat16" and not native_gemm(torch.bfloat16)
    assert converted("auto") == emulated
    assert not converted("model")
    assert converted("float32") == (dtype == "bfloat16")
    with pytest.raises(ValueError, match="matmul_dtype"):
        load_model(path, dtype, matmul_dtype="bfloat16")


def test_ssm_dtype_option_sets_only_the_ssm_state(tmp_path: Path, get_tiny) -> None:
    """``mamba_ssm_cache_dtype`` "float32" under a bf16 model: SSM state fp32, the rest bf16,
    and the forward runs on the mixed pages as close to bf16 transformers as all-bf16 does."""
    hf, _ = get_tiny("qwen3_next")
    lm = load_model(save_checkpoint(hf, tmp_path), "bfloat16", ssm_dtype="float32")
    state = {t.name: t.dtype for c in lm.spec.layers for t in getattr(c.spec, "tensors", ())}
    assert state == {"conv": "bfloat16", "ssm": "float32"}
    assert lm.spec.dtype == "bfloat16"
    ref = hf_logits(copy.deepcopy(hf).to(torch.bfloat16), IDS).float()
    diff = (run(lm) - ref).abs()
    assert float(diff.max()) < 0.15 and float(diff.mean()) < 0.02


def test_ssm_dtype_option_bfloat16_under_an_fp32_model(get_tiny, tmp_path: Path) -> None:
    hf, _ = get_tiny("qwen3_next")
    lm = load_model(save_checkpoint(hf, tmp_path), "float32", ssm_dtype="bfloat16")
    state = {t.name: t.dtype for c in lm.spec.layers for t in getattr(c.spec, "tensors", ())}
    assert state == {"conv": "float32", "ssm": "bfloat16"}
    assert float((run(lm) - hf_logits(hf, IDS)).abs().max()) < 0.1


def test_unknown_model_type_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ValueError):
        load_model(tmp_path, "float32")


def test_parameters_are_built_on_meta_and_loaded_as_read(tmp_path: Path) -> None:
    """Lean loading: no random init, each parameter materialised from its tensor (in the
    target dtype, the same storage when the checkpoint already holds that dtype)."""
    from hybridkv.core.model_config import flatten_text_config, model_spec_from_config
    from hybridkv.models.loader import parameters_on_meta
    from hybridkv.models.registry import model_class

    hf = make_hf_model("qwen3_5_text", tie_word_embeddings=True)
    save_checkpoint(hf, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    spec = model_spec_from_config(raw, name="t")
    with parameters_on_meta():
        empty = model_class(spec.model_type)(flatten_text_config(raw), spec)
    assert all(p.is_meta for p in empty.parameters())
    assert not any(b.is_meta for b in empty.buffers())  # RoPE frequencies are computed
    assert empty.lm_head.weight is empty.model.embed_tokens.weight  # ties survive
    assert not torch.nn.Linear(2, 2).weight.is_meta  # the patch is gone afterwards

    lm = load_model(tmp_path, "float32")
    assert not any(p.is_meta for p in lm.model.parameters())
    assert lm.model.lm_head.weight is lm.model.model.embed_tokens.weight
    on_disk = load_file(tmp_path / "model.safetensors")
    for name, param in lm.model.named_parameters():
        if name in on_disk:
            assert torch.equal(param, on_disk[name].float()), name


def test_tokenizer_from_another_directory(tmp_path: Path) -> None:
    hf = make_hf_model("qwen3_5_text")
    save_checkpoint(hf, tmp_path / "ckpt")
    (tmp_path / "tok").mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "ckpt" / name).rename(tmp_path / "tok" / name)
    assert load_model(tmp_path / "ckpt", "float32").tokenizer is None
    lm = load_model(tmp_path / "ckpt", "float32", tokenizer_dir=tmp_path / "tok")
    assert lm.tokenizer is not None and lm.tokenizer.encode("hello")


def test_unmapped_reads_equal_the_mapped_tensors(tmp_path: Path) -> None:
    """Weights that are packed after loading are read into memory of their own (not left
    mapped from the file): the same names, dtypes, shapes and bits as safetensors' own."""
    from hybridkv.models.loader import iter_safetensors

    gen = torch.Generator().manual_seed(0)
    tensors = {
        "w.bf16": torch.randn(7, 5, generator=gen).to(torch.bfloat16),
        "w.f32": torch.randn(3, 4, 2, generator=gen),
        "w.f16": torch.randn(9, generator=gen).to(torch.float16),
        "ids": torch.arange(6, dtype=torch.int64).view(2, 3),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
    }
    files = []
    for i, names in enumerate((["w.bf16", "ids", "scalar"], ["w.f32", "w.f16", "mask"])):
        files.append(tmp_path / f"part{i}.safetensors")
        save_file({n: tensors[n] for n in names}, files[-1], metadata={"format": "pt"})
    mapped = dict(iter_safetensors(files))
    read = dict(iter_safetensors(files, mapped=False))
    assert mapped.keys() == read.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert read[name].dtype == tensor.dtype and read[name].shape == tensor.shape, name
        assert torch.equal(read[name], tensor) and torch.equal(mapped[name], tensor), name


@pytest.mark.parametrize("matmul_dtype", ["model", "float32"])
def test_packed_load_gives_the_same_logits_in_bfloat16(
    matmul_dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pack_weights``: weights read unmapped and packed (thresholds lowered so the tiny
    model's are), the same bf16 logits as the plain load: the same bits with bf16 weights
    (oneDNN's bf16 products equal F.linear's), within fp32 rounding (then rounded to bf16)
    with the fp32 matmul weights of ``matmul_dtype="float32"`` (packed fp32 sums in
    another order than MKL's)."""
    import hybridkv.layers.packed_linear as packed_linear

    if matmul_dtype == "model" and not packed_linear.can_pack(torch.bfloat16):
        pytest.skip("oneDNN cannot pack bf16 on this CPU (AVX2 alone)")
    path = save_checkpoint(make_hf_model("qwen3_5_text"), tmp_path)
    plain = load_model(path, "bfloat16", matmul_dtype=matmul_dtype)
    for dtype in list(packed_linear.MIN_PACKED_ELEMENTS):
        monkeypatch.setitem(packed_linear.MIN_PACKED_ELEMENTS, dtype, 0)
    packed = load_model(path, "bfloat16", pack_weights=True, matmul_dtype=matmul_dtype)
    assert any(isinstance(m, packed_linear.PackedLinear) for m in packed.model.modules())
    if matmul_dtype == "model":
        assert torch.equal(run(packed), run(plain))
    else:
        torch.testing.assert_close(run(packed), run(plain), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pack_weights_none_packs_small_models_that_multiply_in_bf16(
    dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pack_weights=None`` (the engine's default): a bf16 model that multiplies in bf16
    and whose weights fit :data:`loader.AUTO_PACK_MAX_BYTES` is packed (thresholds lowered
    so the tiny model's linears are); a larger one, an fp32 one (packed fp32 products round
    otherwise than transformers'), and one whose matmuls run in fp32 are not."""
    import hybridkv.layers.packed_linear as packed_linear

    if not packed_linear.can_pack(torch.bfloat16):
        pytest.skip("oneDNN cannot pack bf16 on this CPU (AVX2 alone)")
    path = save_checkpoint(make_hf_model("qwen3_5_text"), tmp_path)
    for key in list(packed_linear.MIN_PACKED_ELEMENTS):
        monkeypatch.setitem(packed_linear.MIN_PACKED_ELEMENTS, key, 0)

    def packs(**options: object) -> bool:
        lm = load_model(path, dtype, pack_weights=None, **options)  # type: ignore[arg-type]
        return any(isinstance(m, packed_linear.PackedLinear) for m in lm.model.modules())

    assert packs(matmul_dtype="model") == (dtype == "bfloat16")
    assert not packs(matmul_dtype="float32")
    monkeypatch.setattr(loader, "AUTO_PACK_MAX_BYTES", 1000)
    assert not packs(matmul_dtype="model")


def test_the_upcast_estimate_counts_a_tied_table_once(tmp_path: Path) -> None:
    """upcast_extra_bytes, read off the bf16 model (as the loader reads it off the model
    built on meta, before the checkpoint): exactly the bytes ``matmul_dtype="float32"``
    adds when the LM head and the embedding share their table (one fp32 copy). Every
    engine family's layout: tests/engine/test_engine_startup.py."""
    hf = make_hf_model("qwen3_5_text", tie_word_embeddings=True)
    path = save_checkpoint(hf, tmp_path)
    bf16 = load_model(path, "bfloat16", matmul_dtype="model")
    fp32 = load_model(path, "bfloat16", matmul_dtype="float32")
    assert upcast_extra_bytes(bf16.model) == fp32.nbytes - bf16.nbytes > 0


def test_auto_keeps_the_model_dtype_where_the_fp32_copies_would_not_fit(
    tmp_path: Path, get_tiny, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On a CPU that emulates bf16 matmuls (patched: any CPU), "auto" holds fp32 copies
    only while the weights with them stay within ``weight_memory_limit``; past it the model
    keeps bf16 matmuls and a warning says why and how to force them. An asked "float32"
    converts anyway, with a warning (regression: "auto" converted whatever the memory, so
    a model that fits in bf16 but not in fp32 would be killed loading)."""
    monkeypatch.setattr(loader, "native_gemm", lambda dtype, device="cpu": False)
    hf, _ = get_tiny("qwen3_next")
    path = save_checkpoint(hf, tmp_path)
    bf16 = load_model(path, "bfloat16", matmul_dtype="model")
    needed = bf16.nbytes + upcast_extra_bytes(bf16.model)

    def converted(matmul_dtype: str, limit: int | None) -> bool:
        lm = load_model(path, "bfloat16", matmul_dtype=matmul_dtype, weight_memory_limit=limit)
        return any(isinstance(m, Fp32Linear) for m in lm.model.modules())

    def warnings() -> list[logging.LogRecord]:  # (an earlier test may leave INFO on)
        return [r for r in caplog.records if r.levelno >= logging.WARNING]

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hybridkv.models.loader"):
        assert converted("auto", None) and converted("auto", needed)
        assert not warnings()
        assert not converted("auto", needed - 1)
        assert "--cpu-matmul-dtype float32" in caplog.text
        caplog.clear()
        assert converted("float32", needed - 1)
        assert "may take beside the cache" in caplog.text


def test_builds_on_meta_in_two_threads_leave_torch_as_it_was() -> None:
    """parameters_on_meta patches two process-wide functions: builds in two threads at
    once take turns, so neither restores the other's patch as the original (which would
    leave every later nn.Linear on meta), and both get meta parameters."""
    register, normal = torch.nn.Module.register_parameter, torch.nn.init.normal_
    built: list[torch.nn.Module] = []
    start = threading.Barrier(2)

    def build() -> None:
        start.wait()
        with loader.parameters_on_meta():
            time.sleep(0.05)  # the other thread enters meanwhile, without the lock
            built.append(torch.nn.Embedding(10, 4))

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(built) == 2 and all(m.weight.is_meta for m in built)
    assert torch.nn.Module.register_parameter is register and torch.nn.init.normal_ is normal
    assert not torch.nn.Linear(2, 2).weight.is_meta

"""The four engine-vs-transformers checks, shared by the LFM2 / Jamba / Falcon-H1 / Zamba2 tests.

Each test file builds one tiny random checkpoint (:func:`build`) and calls the checks on it.
Every comparison is with transformers' *full* forward or its greedy generate, never with its
own chunked path (wrong for Mamba1, notes pitfall 4). Tolerance: 1e-4 x max(1, logit scale).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from paged_runner import PagedRunner
from tiny import hf_greedy, hf_logits, save_checkpoint, transformers

from hybridkv.models.loader import LoadedModel, load_model

CHUNK_SIZES = [1, 6, 9, 17]  # chunk boundaries at 1, 7, 16, 33


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


def build(model_type: str, config: dict[str, Any], model_dir: Path) -> tuple[Any, LoadedModel]:
    """(transformers model, our fp32 model loaded from its saved checkpoint)."""
    hf = make_hf(model_type, config)
    return hf, load_model(save_checkpoint(hf, model_dir), "float32")


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_close(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Max |diff|, asserted within 1e-4 x max(1, |ref| max)."""
    diff = float((got - ref).abs().max())
    assert diff <= 1e-4 * max(1.0, float(ref.abs().max())), diff
    return diff


def check_prefill(hf: Any, lm: LoadedModel, num_tokens: int = 40) -> float:
    ids = prompt(1, num_tokens)
    got = PagedRunner(lm.model, lm.spec).step([("a", ids)], all_logits=True)
    assert torch.isfinite(got).all()
    return assert_close(got, hf_logits(hf, ids))


def check_greedy(hf: Any, lm: LoadedModel, num_steps: int = 32) -> float:
    """Token-for-token greedy equality; a divergence must sit on an HF near-tie."""
    ids = prompt(2, 12)
    tokens, logits = PagedRunner(lm.model, lm.spec, seed=1).greedy("a", ids, num_steps)
    ref_tokens, ref_logits = hf_greedy(hf, ids, num_steps)
    pairs = enumerate(zip(tokens, ref_tokens, strict=True))
    diverged = next((i for i, (a, b) in pairs if a != b), None)
    upto = len(tokens) if diverged is None else diverged + 1
    diff = assert_close(logits[:upto], ref_logits[:upto])
    if diverged is not None:
        top2 = ref_logits[diverged].topk(2).values
        assert float(top2[0] - top2[1]) <= 1e-4, (diverged, tokens, ref_tokens)
    return diff


def check_chunked(hf: Any, lm: LoadedModel, num_tokens: int = 40) -> float:
    """Prefill split at 1, 7, 16, 33 == unsplit == transformers' full forward."""
    ids = prompt(3, num_tokens)
    whole = PagedRunner(lm.model, lm.spec).step([("a", ids)], all_logits=True)
    split = PagedRunner(lm.model, lm.spec, seed=7).prefill_chunks("a", ids, CHUNK_SIZES)
    assert_close(split, whole)
    return assert_close(split, hf_logits(hf, ids))


def check_batched(lm: LoadedModel, num_decodes: int = 4) -> float:
    """Two requests prefilled and decoded in the same steps == each run alone."""
    a, b = prompt(4, 19), prompt(5, 27)
    together = PagedRunner(lm.model, lm.spec, seed=3)
    first = together.step([("a", a), ("b", b)])  # [2, vocab]
    rows, nxt = [first], first.argmax(-1).tolist()
    for _ in range(num_decodes):
        rows.append(together.step([("a", [nxt[0]]), ("b", [nxt[1]])]))
        nxt = rows[-1].argmax(-1).tolist()
    got = torch.stack(rows)  # [steps, 2, vocab]
    diff = 0.0
    for r, ids in enumerate((a, b)):
        alone, ref = PagedRunner(lm.model, lm.spec, seed=11 + r).greedy("x", ids, num_decodes + 1)
        assert got[:, r].argmax(-1).tolist() == alone
        diff = max(diff, assert_close(got[:, r], ref))
    return diff

"""The engine-vs-transformers checks, shared by the model tests of every architecture.

Each test file builds tiny random checkpoints (:func:`build`) in a ``tiny`` fixture and
subclasses :class:`TransformersChecks` to run the four standard checks on them; the Qwen and
Mamba2-hybrid tests also call :func:`check_mixed_batch` and :func:`check_fresh_state_page`.
Every comparison is with transformers' *full* forward or its greedy generate, never with its
own chunked path (wrong for Mamba1, notes pitfall 4). Tolerance: 1e-4 x max(1, logit scale).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from paged_runner import PagedRunner
from tiny import hf_greedy, hf_logits, make_hf, save_checkpoint

from hybridkv.models.loader import LoadedModel, load_model
from hybridkv.ops.paged_state import StateCaptures

CHUNK_SIZES = [1, 6, 9, 17]  # chunk boundaries at 1, 7, 16, 33


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


def check_greedy(hf: Any, lm: LoadedModel, num_steps: int = 32, prompt_tokens: int = 12) -> float:
    """Token-for-token greedy equality; a divergence must sit on an HF near-tie."""
    ids = prompt(2, prompt_tokens)
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


def check_mixed_batch(hf: Any, lm: LoadedModel) -> float:
    """a and c decode while b prefills its second chunk: same logits as the full forward."""
    a, b, c = prompt(6, 30), prompt(7, 45), prompt(8, 17)
    runner = PagedRunner(lm.model, lm.spec, seed=3)
    runner.step([("a", a[:-1]), ("c", c[:-1])])
    runner.step([("b", b[:20])])
    mixed = runner.step([("a", a[-1:]), ("b", b[20:]), ("c", c[-1:])])
    refs = torch.stack([hf_logits(hf, x)[-1] for x in (a, b, c)])
    return assert_close(mixed, refs)


def check_fresh_state_page(hf: Any, lm: LoadedModel) -> None:
    """has_initial_state=False: recurrent state starts from zeros whatever the page holds.

    Checked for a 12-token prompt and a one-token prompt (the decode path).
    """
    runner = PagedRunner(lm.model, lm.spec)
    runner.step([("old", prompt(9, 25))])
    runner.reqs["new"] = runner.reqs.pop("old")  # same pages, full of the old request's state
    runner.reqs["new"].num_computed = 0
    ids = prompt(10, 12)
    assert_close(runner.step([("new", ids)], all_logits=True), hf_logits(hf, ids))
    runner.reqs["one"] = runner.reqs.pop("new")
    runner.reqs["one"].num_computed = 0
    assert_close(runner.step([("one", ids[:1])]), hf_logits(hf, ids[:1]))


def check_captures(lm: LoadedModel, num_tokens: int = 40, first_chunk: int = 9) -> float:
    """States captured inside a prefill chunk == the live states of separate forwards that
    stop at the captured rows, in every recurrent layer (each of its state tensors).

    The request prefills ``first_chunk`` tokens, then the rest in one chunk that captures
    the state after its rows 0, 6, 7, 15, 16, 63, 64 (those it has) and its last: on and
    off chunk and 16-token block boundaries, several per request, and the final row.
    Returns the largest relative difference.
    """
    ids = prompt(11, num_tokens)
    rest = num_tokens - first_chunk
    rows = sorted({r for r in (0, 6, 7, 15, 16, 63, 64) if r < rest} | {rest - 1})
    runner = PagedRunner(lm.model, lm.spec, seed=5)
    runner.step([("a", ids[:first_chunk])])
    groups = [g for g in lm.spec.groups if g.is_recurrent]
    pages = {g.group_id: [runner.allocator.allocate(g.group_id) for _ in rows] for g in groups}
    batch = runner.build_batch([("a", ids[first_chunk:])], all_logits=False)
    batch.state_captures = {
        gid: StateCaptures(torch.tensor(rows), torch.tensor(dst)) for gid, dst in pages.items()
    }
    lm.model(batch, runner.views)
    worst = 0.0
    for i, row in enumerate(rows):
        alone = PagedRunner(lm.model, lm.spec, seed=6)
        alone.step([("b", ids[: first_chunk + row + 1])])
        for group in groups:
            live = alone.reqs["b"].state_page[group.group_id]
            for layer in group.layers:
                ours = runner.views.state(layer.layer_index).tensors
                for name, view in ours.items():
                    want = alone.views.state(layer.layer_index)[name][live]
                    got = view[pages[group.group_id][i]]
                    rel = float((got - want).abs().max() / want.abs().max())
                    assert rel <= 1e-5, (row, layer.layer_index, name, rel)
                    worst = max(worst, rel)
    return worst


class TransformersChecks:
    """The standard checks as tests, over the test module's ``tiny`` fixture.

    A test module defines ``tiny`` (``(transformers model, LoadedModel)``) and a
    ``class Test<Arch>(TransformersChecks)``; the class attributes set the prompt lengths.
    """

    prefill_tokens = 40
    chunked_tokens = 40

    def test_prefill_matches_full_forward(self, tiny: tuple[Any, LoadedModel]) -> None:
        check_prefill(*tiny, num_tokens=self.prefill_tokens)

    def test_greedy_decode_matches_generate(self, tiny: tuple[Any, LoadedModel]) -> None:
        check_greedy(*tiny)

    def test_chunked_prefill_matches_unsplit(self, tiny: tuple[Any, LoadedModel]) -> None:
        check_chunked(*tiny, num_tokens=self.chunked_tokens)

    def test_batched_requests_match_alone(self, tiny: tuple[Any, LoadedModel]) -> None:
        check_batched(tiny[1])

    def test_state_captured_inside_prefill_equals_live_state(
        self, tiny: tuple[Any, LoadedModel]
    ) -> None:
        check_captures(tiny[1])

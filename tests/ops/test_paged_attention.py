"""Paged attention == dense causal attention; never reads unwritten slots or -1 pages.

The batched op (one SDPA call for the decodes, one padded call per batch of similar prefill
chunks) is checked against the per-request reference and against dense attention on ragged
steps, with the prefills in one batch and split into several:
fresh prefills of different lengths, chunks after a cached prefix, decodes, sliding
windows, GQA, a value dim unlike the key dim, all in an arena of NaN with pages scattered.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from hybridkv.ops.paged_attention import (
    batched,
    build_attention_plan,
    paged_attention,
    paged_attention_reference,
    plan,
    store_kv,
    store_kv_reference,
)

B, HQ, HKV, D, DV = 4, 6, 2, 8, 5  # GQA 3:1, value dim != key dim
SCALE = D**-0.5


def dense_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, window: int | None) -> Tensor:
    """q [n, Hq, D], k/v [L, Hkv, *] for positions 0..L-1."""
    k, v = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * SCALE
    k_pos = torch.arange(k.shape[0])
    allowed = k_pos[None] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None] > q_pos[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


@dataclass
class Step:
    """One step's tensors over a NaN arena, each request's full K/V kept for the reference."""

    computed: list[int]
    new: list[int]
    window: int | None
    dtype: torch.dtype = torch.float32
    seed: int = 0
    layout: str = "apart"  # "kv" / "vk": K and V in one page of an arena, as the engine's
    decode_key_multiple: int = 1  # the decodes' key columns padded to a multiple of this

    def __post_init__(self) -> None:
        gen = torch.Generator().manual_seed(self.seed)
        self.total = [c + n for c, n in zip(self.computed, self.new, strict=True)]
        num_pages = sum(-(-t // B) for t in self.total) + 3
        if self.layout == "apart":
            self.key_cache = torch.full((num_pages, B, HKV, D), float("nan"), dtype=self.dtype)
            self.value_cache = torch.full((num_pages, B, HKV, DV), float("nan"), dtype=self.dtype)
        else:  # pages of [K | V | another layer's bytes] or [V | K | ...], value dim D
            self.key_cache, self.value_cache = arena_pages(num_pages, self.dtype)
            if self.layout == "vk":
                self.key_cache, self.value_cache = self.value_cache, self.key_cache
        value_dim = self.value_cache.shape[-1]
        width = max(-(-t // B) for t in self.total)
        self.tables = torch.full((len(self.total), width), -1)
        pages = iter(torch.randperm(num_pages, generator=gen).tolist())
        self.full_k = [torch.randn(t, HKV, D, generator=gen).to(self.dtype) for t in self.total]
        self.full_v = [
            torch.randn(t, HKV, value_dim, generator=gen).to(self.dtype) for t in self.total
        ]
        for r, t in enumerate(self.total):
            first_needed = 0 if self.window is None else self.computed[r] - self.window + 1
            for blk in range(-(-t // B)):
                if (blk + 1) * B > first_needed:  # blocks wholly outside the window stay -1
                    self.tables[r, blk] = next(pages)
            for p in range(max(0, first_needed), self.computed[r]):  # the cached prefix
                self.key_cache[self.tables[r, p // B], p % B] = self.full_k[r][p]
                self.value_cache[self.tables[r, p // B], p % B] = self.full_v[r][p]
        self.positions = torch.cat(
            [torch.arange(c, c + n) for c, n in zip(self.computed, self.new, strict=True)]
        )
        self.starts = [0, *torch.tensor(self.new).cumsum(0).tolist()]
        self.query = torch.randn(sum(self.new), HQ, D, generator=gen).to(self.dtype)
        self.k_new = torch.cat([k[c:] for k, c in zip(self.full_k, self.computed, strict=True)])
        self.v_new = torch.cat([v[c:] for v, c in zip(self.full_v, self.computed, strict=True)])

    def run_batched(self) -> Tensor:
        plan = build_attention_plan(
            self.tables,
            self.starts,
            self.total,
            self.positions,
            B,
            self.window,
            self.decode_key_multiple,
        )
        store_kv(self.k_new, self.v_new, self.key_cache, self.value_cache, plan)
        return paged_attention(self.query, self.key_cache, self.value_cache, plan, SCALE)

    def run_reference(self) -> Tensor:
        lens = torch.tensor(self.new)
        token_req = torch.repeat_interleave(torch.arange(len(self.new)), lens)
        store_kv_reference(
            self.k_new,
            self.v_new,
            self.key_cache,
            self.value_cache,
            self.tables,
            token_req,
            self.positions,
        )
        return paged_attention_reference(
            self.query,
            self.key_cache,
            self.value_cache,
            self.tables,
            self.starts,
            self.total,
            self.positions,
            SCALE,
            self.window,
        )

    def dense(self, r: int) -> Tensor:
        lo, hi = self.starts[r], self.starts[r + 1]
        q = self.query[lo:hi].float()
        k, v = self.full_k[r].float(), self.full_v[r].float()
        return dense_attention(q, k, v, self.positions[lo:hi], self.window)


def arena_pages(num_pages: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Two [num_pages, B, HKV, D] views of one NaN arena, adjacent in every page and
    followed by another tensor's bytes (the engine's layout, forward/views.py)."""
    slot = B * HKV * D
    arena = torch.full((num_pages * 3 * slot,), float("nan"), dtype=dtype)
    first, second = (
        arena.as_strided((num_pages, B, HKV, D), (3 * slot, HKV * D, D, 1), offset)
        for offset in (0, slot)
    )
    return first, second


STEPS = {
    # request 0 prefills 9 from scratch, 1 decodes at 13, 2 continues 6 after 7
    "mixed": ([0, 13, 7], [9, 1, 6]),
    # decodes of lengths 1..23 around one prefill chunk
    "decodes": ([0, 12, 4, 1, 22, 0, 7, 3], [1, 1, 5, 1, 1, 1, 1, 1]),
    # fresh prefills of different lengths only (the causal fast path)
    "fresh_ragged": ([0, 0, 0, 0], [2, 17, 5, 11]),
    # chunks after cached prefixes of different lengths, no decode
    "prefix_ragged": ([3, 30, 0, 12], [14, 2, 7, 9]),
    # one long prefill beside short ones and decodes
    "long_short": ([0, 5, 40, 2, 0], [37, 1, 1, 3, 2]),
}


@pytest.fixture(params=["one_prefill_batch", "split_prefills"])
def split_prefills(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """The tests' steps are small enough for one prefill batch; "split_prefills" gives every
    prefill shape a batch of its own (no padding allowed)."""
    split = request.param == "split_prefills"
    if split:
        monkeypatch.setattr(plan, "PADDING_SLACK", 1.0)
        monkeypatch.setattr(plan, "SMALL_BATCH_SCORES", 0)
    return split


@pytest.mark.parametrize("window", [None, 5, 64], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("name", list(STEPS))
def test_batched_matches_reference_and_dense(
    name: str, window: int | None, split_prefills: bool
) -> None:
    computed, new = STEPS[name]
    batched_step = Step(computed, new, window, seed=len(name))
    out = batched_step.run_batched()
    assert torch.isfinite(out).all()
    reference_step = Step(computed, new, window, seed=len(name))
    ref = reference_step.run_reference()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batched_step.key_cache, reference_step.key_cache, equal_nan=True)
    torch.testing.assert_close(batched_step.value_cache, reference_step.value_cache, equal_nan=True)
    for r in range(len(new)):
        lo, hi = batched_step.starts[r], batched_step.starts[r + 1]
        torch.testing.assert_close(out[lo:hi], batched_step.dense(r), atol=1e-5, rtol=1e-5)


@pytest.fixture(params=["native", "emulated"])
def bf16_gemm(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Attention takes bf16 matmuls only where the device multiplies bf16 natively
    (ops/cpu_gemm.py), else SDPA: both paths, whatever this machine's CPU has."""
    native = request.param == "native"
    monkeypatch.setattr(batched, "native_gemm", lambda dtype, device="cpu": native)
    return str(request.param)


@pytest.fixture
def bf16_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bf16 matmul path, as on a CPU that multiplies bf16 natively (it runs on any
    CPU; where bf16 is emulated it is only slower than SDPA, so the engine skips it)."""
    monkeypatch.setattr(batched, "native_gemm", lambda dtype, device="cpu": True)


@pytest.mark.parametrize("multiple", [1, 16, 64], ids=lambda m: f"keys_x{m}")
@pytest.mark.parametrize("window", [None, 5], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("name", ["mixed", "decodes", "fresh_ragged", "prefix_ragged"])
def test_bf16_batched_matches_reference(
    name: str, window: int | None, multiple: int, bf16_gemm: str
) -> None:
    """In bf16 the decodes and prefills run as two matmuls around an fp32 softmax where
    bf16 matmuls are native, as SDPA where they are emulated: either way within bf16
    rounding of the reference and of dense fp32 attention, whatever multiple the decodes'
    key columns are padded to (16 and 64: more columns than the longest request's pages
    hold, in a NaN arena)."""
    computed, new = STEPS[name]
    step = Step(computed, new, window, torch.bfloat16, seed=3, decode_key_multiple=multiple)
    out = step.run_batched()
    ref = Step(computed, new, window, torch.bfloat16, seed=3).run_reference()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    for r in range(len(new)):
        lo, hi = step.starts[r], step.starts[r + 1]
        torch.testing.assert_close(out[lo:hi].float(), step.dense(r).float(), atol=2e-2, rtol=2e-2)


@pytest.fixture
def sdpa_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per SDPA call the paged attention makes (the real SDPA runs)."""
    real_sdpa = torch.nn.functional.scaled_dot_product_attention
    calls: list[int] = []

    def sdpa_spy(*args: object, **kwargs: object) -> Tensor:
        calls.append(1)
        return real_sdpa(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(batched.F, "scaled_dot_product_attention", sdpa_spy)
    return calls


@pytest.mark.usefixtures("bf16_native")
@pytest.mark.parametrize("layout", ["apart", "kv"])
def test_masked_bf16_prefills_run_as_matmuls_in_groups(
    layout: str, monkeypatch: pytest.MonkeyPatch, sdpa_calls: list[int]
) -> None:
    """bf16 prefill chunks with a mask (after cached prefixes, padded to one batch) run as
    two matmuls around an fp32 softmax (batched._matmul_attention), never SDPA: within bf16
    rounding of dense fp32 attention, and the same bits whether every request's scores are
    computed at once, one request at a time, or a block of one request's queries at a time
    (the workspace bound)."""
    computed, new = STEPS["prefix_ragged"]  # four chunks after prefixes, no decode

    def run() -> tuple[Step, Tensor]:
        step = Step(computed, new, None, torch.bfloat16, seed=5, layout=layout)
        return step, step.run_batched()

    step, together = run()
    assert torch.isfinite(together).all()
    for r in range(len(new)):
        lo, hi = step.starts[r], step.starts[r + 1]
        dense = step.dense(r).float()
        torch.testing.assert_close(together[lo:hi].float(), dense, atol=2e-2, rtol=2e-2)
    widest = max(-(-t // B) for t in step.total) * B  # the batch's key columns
    one_request = HQ * max(new) * widest
    for bound in (one_request, one_request - 1, HQ * widest, 1):  # requests, query blocks
        monkeypatch.setattr(batched, "MATMUL_SCORES", bound)
        assert torch.equal(run()[1], together)
    assert not sdpa_calls


def test_matmul_attention_same_bits_for_any_mask_dtype() -> None:
    """The matmul attention adds its 0 / -inf mask to fp32 logits, so a bf16 mask (what the
    engine passes: half the bytes) gives the fp32 mask's bits, and the in-place softmax the
    bits of a softmax into a separate buffer (the form it replaced)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, HQ, 7, D, generator=gen).bfloat16()
    k = torch.randn(3, HKV, 40, D, generator=gen).bfloat16()
    v = torch.randn(3, HKV, 40, DV, generator=gen).bfloat16()
    keep = torch.rand(3, 1, 7, 40, generator=gen) > 0.4
    keep[..., 0] = True  # every query row keeps a key
    mask32 = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    out = batched._matmul_attention(q, k, v, mask32, SCALE)
    assert torch.equal(batched._matmul_attention(q, k, v, mask32.bfloat16(), SCALE), out)
    rep = HQ // HKV
    scores = (q.view(3, HKV, rep * 7, D) @ k.transpose(-1, -2)).float().view(3, HQ, 7, 40)
    probs = torch.softmax(scores * SCALE + mask32, dim=-1).bfloat16().view(3, HKV, rep * 7, 40)
    assert torch.equal((probs @ v).view(3, HQ, 7, DV), out)


@pytest.mark.usefixtures("bf16_native")
def test_fresh_bf16_prefills_run_as_matmuls_over_the_causal_triangle(
    monkeypatch: pytest.MonkeyPatch, sdpa_calls: list[int]
) -> None:
    """bf16 chunks that all start at position 0 (no mask: the causal rule) run as the same
    matmuls over a causal triangle, within bf16 rounding of dense fp32 attention, the same
    bits split by query block; a batch whose triangle (queries x keys) passes the bound
    keeps SDPA's causal kernel, within rounding of the matmuls."""
    computed, new = STEPS["fresh_ragged"]

    def run() -> tuple[Step, Tensor]:
        step = Step(computed, new, None, torch.bfloat16, seed=6)
        return step, step.run_batched()

    step, together = run()
    assert not sdpa_calls and torch.isfinite(together).all()
    for r in range(len(new)):
        lo, hi = step.starts[r], step.starts[r + 1]
        dense = step.dense(r).float()
        torch.testing.assert_close(together[lo:hi].float(), dense, atol=2e-2, rtol=2e-2)
    built = build_attention_plan(step.tables, step.starts, step.total, step.positions, B, None)
    rows = [p.query_rows for p in built.prefills]  # [R, Lq], or a slice of one chunk
    q_lens = [r.shape[-1] if isinstance(r, Tensor) else r.stop - r.start for r in rows]
    # the largest batch's queries x keys
    triangle = max(n * p.keys.width for n, p in zip(q_lens, built.prefills, strict=True))
    monkeypatch.setattr(batched, "MATMUL_SCORES", triangle)  # blocks of a few queries
    assert torch.equal(run()[1], together) and not sdpa_calls
    monkeypatch.setattr(batched, "MATMUL_SCORES", triangle - 1)
    _, sdpa = run()
    assert sdpa_calls
    torch.testing.assert_close(sdpa, together, atol=2e-2, rtol=2e-2)


def test_masked_prefills_keep_sdpa_for_a_tracked_cache_and_for_fp16() -> None:
    """Regressions of the matmul prefill (a2d0cfa, found in review): a bf16 chunk after a
    prefix whose new keys autograd tracks (the cache then requires grad; the matmuls write
    into workspace buffers, which autograd refuses) attends and back-propagates; an fp16
    chunk whose q.k passes fp16's range (65,504) before the scale stays finite (SDPA),
    within rounding of the reference; and so do fp16 decodes (the same overflow made them
    NaN since they ran as matmuls, before a2d0cfa too)."""
    step = Step([6], [3], None, torch.bfloat16, seed=2)
    step.k_new.requires_grad_(True)
    out = step.run_batched()
    out.float().sum().backward()
    assert step.k_new.grad is not None and torch.isfinite(step.k_new.grad).all()
    for name in ("prefix_ragged", "decodes"):
        computed, new = STEPS[name]
        loud, ref_step = (Step(computed, new, None, torch.float16, seed=4) for _ in range(2))
        for each in (loud, ref_step):  # |q.k| ~ 200 * 200 * D: past fp16's range
            each.query.mul_(200.0)
            each.k_new.mul_(200.0)
            for p in range(each.key_cache.shape[0]):
                each.key_cache[p].mul_(200.0)  # NaN pages stay NaN
        out = loud.run_batched()
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, ref_step.run_reference(), atol=2e-2, rtol=2e-2)


@pytest.mark.usefixtures("bf16_native")
def test_matmul_decodes_keep_their_shapes_while_keys_grow() -> None:
    """bf16 decodes pad their key columns to a multiple of 64, so a decode batch whose keys
    grow by one a step gives its matmuls one shape for 64 steps (oneDNN builds a kernel per
    new shape, batched.decode_key_multiple); fp32 and fp16 (SDPA) keep exact widths."""
    assert batched.decode_key_multiple(torch.float32) == 1
    assert batched.decode_key_multiple(torch.float16) == 1
    multiple = batched.decode_key_multiple(torch.bfloat16)
    assert multiple == 64
    widths = set()
    for length in range(130, 190):
        step = Step([length - 1, length + 5], [1, 1], None)
        built = build_attention_plan(
            step.tables, step.starts, step.total, step.positions, B, None, multiple
        )
        assert built.decode is not None
        widths.add(built.decode.keys.width)
        assert int(built.decode.keys.valid.sum()) == 2 * length + 6  # padding stays masked
    assert widths == {192, 256}


def test_emulated_bf16_attends_through_sdpa_over_exact_widths(
    monkeypatch: pytest.MonkeyPatch, sdpa_calls: list[int]
) -> None:
    """Where bf16 matmuls are emulated (a CPU with AVX2 alone), bf16 decodes and prefills
    run SDPA, whose kernel computes in fp32 inside, and the decodes' key columns are not
    padded (the padding only served the matmuls' shapes)."""
    monkeypatch.setattr(batched, "native_gemm", lambda dtype, device="cpu": False)
    assert batched.decode_key_multiple(torch.bfloat16) == 1
    for name in ("decodes", "prefix_ragged", "fresh_ragged"):
        computed, new = STEPS[name]
        sdpa_calls.clear()
        out = Step(computed, new, None, torch.bfloat16, seed=7).run_batched()
        ref = Step(computed, new, None, torch.bfloat16, seed=7).run_reference()
        assert sdpa_calls, name
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def test_plan_uses_causal_rule_only_without_a_prefix() -> None:
    fresh = Step([0, 0], [3, 5], None)
    built = build_attention_plan(fresh.tables, fresh.starts, fresh.total, fresh.positions, B, None)
    [prefill] = built.prefills
    assert prefill.keys.mask is None and built.decode is None
    resumed = Step([0, 4], [3, 5], None)
    built = build_attention_plan(
        resumed.tables, resumed.starts, resumed.total, resumed.positions, B, None
    )
    [prefill] = built.prefills
    assert prefill.keys.mask is not None and prefill.keys.mask.shape == (2, 1, 5, 9)


def test_split_prefill_batches_choose_the_causal_rule_each() -> None:
    """A fresh chunk batched apart from a resumed one keeps SDPA's own causal rule."""
    step = Step([0, 700], [300, 20], None)
    built = build_attention_plan(step.tables, step.starts, step.total, step.positions, B, None)
    assert [p.query_rows for p in built.prefills] == [slice(0, 300), slice(300, 320)]
    assert built.prefills[0].keys.mask is None
    assert built.prefills[1].keys.mask is not None


def test_prefill_groups_bound_the_padding() -> None:
    # issue 13's W3 step: one 554-token chunk and 31 of 50 tokens, all after 1500 cached
    shapes = [(554, 2054)] + [(50, 1550)] * 31
    groups = plan.prefill_groups(shapes, list(range(100, 132)))
    assert groups == [[100], list(range(101, 132))]
    # equal shapes: one batch; small steps: one batch whatever the shapes
    assert plan.prefill_groups([(128, 128)] * 64, list(range(64))) == [list(range(64))]
    assert plan.prefill_groups([(9, 9), (2, 2), (40, 45)], [0, 1, 2]) == [[0, 1, 2]]
    # ragged lengths: every request once, each batch in step order, padding within bounds
    shapes = [(q, q + 100 * (q % 3)) for q in (700, 30, 420, 64, 900, 65, 300, 2, 128)]
    groups = plan.prefill_groups(shapes, list(range(len(shapes))))
    assert sorted(r for g in groups for r in g) == list(range(len(shapes)))
    for group in groups:
        assert group == sorted(group)
        real = sum(shapes[r][0] * shapes[r][1] for r in group)
        padded = len(group) * max(shapes[r][0] for r in group) * max(shapes[r][1] for r in group)
        assert padded <= max(plan.PADDING_SLACK * real, real + plan.SMALL_BATCH_SCORES)
    assert 1 < len(groups) < len(shapes)


def random_keys(gen: torch.Generator, num_pages: int, n: int, width: int) -> plan.KeyGather:
    """Columns of ``n`` requests over random pages, some padding, first key anywhere."""
    pages = torch.randint(0, num_pages, (n, -(-width // B)), generator=gen)
    first = torch.randint(0, B, (n, 1), generator=gen)
    valid = torch.rand(n, width, generator=gen) < 0.8
    valid |= torch.arange(width) == first  # the first needed key is a key
    return plan.KeyGather(pages, valid, first, B, None)


@pytest.mark.parametrize("padded", [False, True], ids=["contiguous", "strided_slots"])
def test_head_major_gather_equals_the_transposed_one(padded: bool) -> None:
    """The decode gather straight into [n, Hkv, Lk, d] reads what the slot gather reads,
    whether the slots are packed (one index_select of head rows) or not (the fallback)."""
    gen = torch.Generator().manual_seed(5)
    full = torch.randn(7, B, HKV + (1 if padded else 0), D, generator=gen, dtype=torch.bfloat16)
    cache = full[:, :, :HKV]  # padded: slot stride (HKV + 1) * D, not HKV * D
    keys = random_keys(gen, 7, 3, 10)
    got = batched._gather(cache, keys, torch.float32, head_major=True)
    want = batched._gather(cache, keys, torch.float32)
    assert got.is_contiguous() and got.shape == (3, HKV, 10, D)
    assert torch.equal(got, want)
    pages, slots = keys.pages_slots()
    assert torch.equal(want, cache[pages, slots].float().transpose(1, 2))


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [None, 5], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("name", ["mixed", "decodes", "prefix_ragged", "long_short"])
def test_kv_in_one_page_gathered_together(
    name: str, window: int | None, dtype: torch.dtype, layout: str
) -> None:
    """K and V of a layer in the same pages of an arena (the engine's layout) are gathered
    by one index_select; equal to the reference, NaN all around them."""
    computed, new = STEPS[name]
    step = Step(computed, new, window, dtype, seed=7, layout=layout)
    assert batched._row_view((step.key_cache, step.value_cache), head_major=False) is not None
    assert batched._row_view((step.key_cache, step.value_cache), head_major=True) is not None
    out = step.run_batched()
    ref = Step(computed, new, window, dtype, seed=7, layout=layout).run_reference()
    assert torch.isfinite(out).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("multiple", [1, 16], ids=lambda m: f"keys_x{m}")
@pytest.mark.parametrize("window", [None, 3, 5, 64], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("name", list(STEPS))
def test_gathers_read_only_the_requests_needed_keys(
    name: str, window: int | None, multiple: int
) -> None:
    """Every column of every gather, padding included, is a slot its request wrote and
    needs: a position in [first needed, seq_len), at its page of the block table."""
    computed, new = STEPS[name]
    step = Step(computed, new, window)
    built = build_attention_plan(
        step.tables, step.starts, step.total, step.positions, B, window, multiple
    )
    if built.decode is not None:
        assert built.decode.keys.width % multiple == 0
    batches: list[tuple[list[int], plan.KeyGather]] = []
    decodes = [r for r, n in enumerate(new) if n == 1]
    if built.decode is not None:
        batches.append((decodes, built.decode.keys))
    for prefill in built.prefills:
        rows = prefill.out_rows
        first_rows = set(range(rows.start, rows.stop) if isinstance(rows, slice) else rows.tolist())
        batches.append(
            (
                [r for r in range(len(new)) if step.starts[r] in first_rows and new[r] > 1],
                prefill.keys,
            )
        )
    assert sorted(r for requests, _ in batches for r in requests) == list(range(len(new)))
    for requests, keys in batches:
        pages, slots = keys.pages_slots()
        for i, r in enumerate(requests):
            first = 0 if window is None else max(0, computed[r] - window + 1)
            needed = {(int(step.tables[r, p // B]), p % B) for p in range(first, step.total[r])}
            read = set(zip(pages[i].tolist(), slots[i].tolist(), strict=True))
            assert read <= needed
            valid = keys.valid[i]
            assert int(valid.sum()) == len(needed)  # each needed key once
            kept = set(zip(pages[i][valid].tolist(), slots[i][valid].tolist(), strict=True))
            assert kept == needed


def test_row_views_are_remembered_per_cache_and_forgotten_with_it() -> None:
    """A layer's row view is derived once (the engine's page views live as long as it) and
    dropped when one of its caches is freed, so a new tensor at the same id is not served
    a stale view."""
    key, value = arena_pages(4, torch.float32)
    seen = batched._row_view((key, value), head_major=False)
    assert seen is not None
    assert batched._row_view((key, value), head_major=False) is seen
    assert (key, value) in batched._ROW_VIEWS
    remembered = len(batched._ROW_VIEWS)
    del key
    assert len(batched._ROW_VIEWS) == remembered - 1

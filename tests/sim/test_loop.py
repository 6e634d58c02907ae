"""The simulated scheduler on the real core: exact hits on a tiny trace, all designs at scale.

"The simulator and the engine agree on hit tokens for the same trace on a tiny model" is
tests/engine/test_engine_matches_simulator.py: the hand trace below, with the engine's real
replies as output tokens, replayed through both.
"""

from __future__ import annotations

import pytest

from hybridkv.core.manager import CacheConfig, CacheManager
from hybridkv.sim.compare import make_setup, run_design
from hybridkv.sim.designs import DESIGNS, unified_block_tokens
from hybridkv.sim.loop import SimConfig, Simulator
from hybridkv.sim.traces import Trace
from hybridkv.sim.workloads import ChatWorkload, chat_trace
from tests.sim.sim_factories import make_request, make_tiny_cost, make_tiny_model

GIB = 1 << 30


def make_hand_trace() -> Trace:
    """Block 16. r0: 40-token prompt, 10 outputs. r1: r0's 50 tokens + 10 new. r2: r0's prompt.

    r0 snapshots at 32 (prompt end: floor(39 / 16) * 16) and at 48 (a block boundary
    crossed in decode: 40 + 9 computed outputs = 49 tokens); retention keeps both (32 is
    the prompt end). r1 resumes at 48 (its last 12 tokens are new or partial), r2 at 32
    (a repeat of r0's prompt; the last token is always recomputed). Hits: 0 + 48 + 32.
    """
    prompt0 = list(range(40))
    r0 = make_request("r0", prompt0, 10, first_output=1000)
    r1_prompt = [*prompt0, *r0.output_token_ids, *range(2000, 2010)]
    r1 = make_request("r1", r1_prompt, 3, after="r0")
    r2 = make_request("r2", prompt0, 4, after="r1", first_output=3000)
    return Trace(requests=(r0, r1, r2))


def test_hand_counted_hits() -> None:
    model = make_tiny_model()
    manager = CacheManager(model, CacheConfig(memory_bytes=1 << 20, block_tokens=16))
    config = SimConfig(check_integrity=True)
    result = Simulator(make_hand_trace(), manager, make_tiny_cost(model), config).run()
    assert result.prompt_tokens == 40 + 60 + 40
    assert result.hit_tokens == 48 + 32
    assert result.output_tokens == 10 + 3 + 4
    assert result.snapshots_taken >= 2 and result.preemptions == 0
    assert len(result.ttfts_s) == 3 and all(t > 0 for t in result.ttfts_s)


def test_tight_memory_preempts_and_still_finishes() -> None:
    model = make_tiny_model()
    probe = CacheManager(model, CacheConfig(memory_bytes=1 << 20))
    memory = 6 * probe.layout.chunk_bytes
    manager = CacheManager(model, CacheConfig(memory_bytes=memory, block_tokens=16))
    trace = Trace(
        requests=tuple(make_request(f"r{i}", [i] * 24, 40, first_output=100 * i) for i in range(4))
    )
    config = SimConfig(check_integrity=True)
    result = Simulator(trace, manager, make_tiny_cost(model), config).run()
    assert result.num_rejected == 0 and result.output_tokens == 4 * 40
    assert result.preemptions > 0  # 6 chunks: two requests' states and KV at most


@pytest.fixture(scope="module")
def small_chat() -> Trace:
    return chat_trace(ChatWorkload(num_conversations=4, turns=3, seed=1))


@pytest.mark.parametrize("design", list(DESIGNS))
def test_every_design_runs_qwen35_27b(design: str, small_chat: Trace) -> None:
    setup = make_setup("qwen3.5-27b")
    result = run_design(setup, small_chat, design, 8 * GIB)
    assert result.num_rejected == 0
    assert result.output_tokens == small_chat.num_output_tokens
    assert result.prompt_tokens == small_chat.num_prompt_tokens
    assert 0 <= result.hit_tokens < result.prompt_tokens
    assert result.ttft_mean_s > 0 and result.throughput_tok_s > 0
    if design.startswith("hybridkv"):
        assert result.token_hit_rate > 0.3  # later turns resume from the previous turn
    again = run_design(setup, small_chat, design, 8 * GIB)
    assert again.to_json() == result.to_json()  # reproducible run to run


def test_unified_block_is_vllms_inflated_block() -> None:
    assert unified_block_tokens(make_setup("qwen3.5-27b").model) == 784

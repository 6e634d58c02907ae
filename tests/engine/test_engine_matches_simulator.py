"""The simulator and the engine agree on hit tokens for the same trace (issue 6).

The engine runs a tiny model for real; its replies become the trace's output tokens; the
simulator replays that trace on a CacheManager built from the same model spec and cache
config. Both schedule through the same core, so every request must find exactly the same
cached prefix in both (hand-counted: 0, 48, 32, as in tests/sim/test_loop.py).
"""

from __future__ import annotations

from typing import Any

from hybrid_checks import prompt

from hybridkv import LLM, SamplingParams
from hybridkv.core.manager import CacheConfig, CacheManager
from hybridkv.sim.loop import SimConfig, Simulator
from hybridkv.sim.traces import Trace, TraceRequest
from tests.sim.sim_factories import make_tiny_cost

MEMORY_GIB = 0.02


def test_engine_and_simulator_find_the_same_hits(checkpoints: Any) -> None:
    _, path = checkpoints("qwen3_5_text")
    llm = LLM(str(path), cache_memory_gib=MEMORY_GIB, max_model_len=256, block_size=16)
    prompt0 = prompt(40, 40)

    def run(ids: list[int], num_tokens: int) -> tuple[list[int], int]:
        params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        return out.outputs[0].token_ids, out.num_cached_tokens

    out0, hit0 = run(prompt0, 10)
    prompt1 = prompt0 + out0 + prompt(41, 10)
    out1, hit1 = run(prompt1, 3)
    out2, hit2 = run(prompt0, 4)
    assert [hit0, hit1, hit2] == [0, 48, 32]

    def request(req_id: str, ids: list[int], out: list[int], after: str | None) -> TraceRequest:
        return TraceRequest(
            req_id=req_id, prompt_token_ids=tuple(ids), output_token_ids=tuple(out), after=after
        )

    trace = Trace(
        requests=(
            request("r0", prompt0, out0, None),
            request("r1", prompt1, out1, "r0"),
            request("r2", prompt0, out2, "r1"),
        )
    )
    config = llm.engine.manager.config
    assert config == CacheConfig(memory_bytes=int(MEMORY_GIB * (1 << 30)), block_tokens=16)
    manager = CacheManager(llm.engine.spec, config)
    sim = Simulator(trace, manager, make_tiny_cost(llm.engine.spec), SimConfig())
    result = sim.run()
    assert result.hit_tokens == hit0 + hit1 + hit2
    assert result.prompt_tokens == llm.stats()["prefix_cache_queries"]
    assert result.hit_tokens == llm.stats()["prefix_cache_hits"]

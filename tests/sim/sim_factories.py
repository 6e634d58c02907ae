"""Tiny models, cost models and traces for the simulator tests."""

from __future__ import annotations

from hybridkv.core.spec import (
    AttentionSpec,
    LayerCache,
    ModelSpec,
    RecurrentStateSpec,
    StateKind,
    StateTensorSpec,
)
from hybridkv.sim.cost import CostModel, ModelCost
from hybridkv.sim.gpus import get_gpu
from hybridkv.sim.traces import TraceRequest


def make_tiny_model() -> ModelSpec:
    """One attention layer and one recurrent layer with a small state."""
    attn = AttentionSpec(num_kv_heads=1, head_dim=8, value_head_dim=8, dtype="bfloat16")
    state = RecurrentStateSpec(
        kind=StateKind.MAMBA2,
        tensors=(StateTensorSpec(name="ssm", shape=(256,), dtype="float32"),),
    )
    return ModelSpec(
        name="tiny",
        model_type="tiny",
        num_layers=2,
        dtype="bfloat16",
        max_model_len=None,
        layers=(
            LayerCache(layer_index=0, name="attn", spec=attn),
            LayerCache(layer_index=1, name="state", spec=state),
        ),
    )


def make_tiny_cost(model: ModelSpec) -> CostModel:
    cost = ModelCost(
        total_params=1e6,
        active_params=1e6,
        params_source="test",
        attn_flops_per_pair=32.0,
        recurrent_flops_per_token=1024.0,
        kv_bytes_per_token=model.kv_bytes_per_token,
        state_bytes_per_seq=model.state_bytes_per_seq,
    )
    return CostModel(cost, get_gpu("H100"))


def make_request(
    req_id: str,
    prompt: list[int],
    num_output: int,
    *,
    after: str | None = None,
    arrival: int = 0,
    first_output: int = 10_000,
) -> TraceRequest:
    return TraceRequest(
        req_id=req_id,
        prompt_token_ids=tuple(prompt),
        output_token_ids=tuple(range(first_output, first_output + num_output)),
        after=after,
        arrival_step=arrival,
    )

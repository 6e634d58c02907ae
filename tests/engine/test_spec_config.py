"""speculative_config: vLLM's dict shape, its defaults, and one clear error per mistake."""

from __future__ import annotations

from typing import Any

import pytest

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.spec_decode.config import SpeculativeConfig


def test_ngram_defaults_are_vllms() -> None:
    both = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)
    only_max = SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    )
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    only_min = SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
    )
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 2)
    assert only_min.to_dict() == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 2,
    }


def test_a_model_without_a_method_is_a_draft_model() -> None:
    config = SpeculativeConfig.parse({"model": "/d", "num_speculative_tokens": 2})
    assert config.method == "draft_model" and config.model == "/d"
    assert config.to_dict() == {"method": "draft_model", "num_speculative_tokens": 2, "model": "/d"}


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ([1, 2], "must be a dict"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
        ({"num_speculative_tokens": 2}, "needs a method"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown keys ['k']"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
            "prompt_lookup_min must be",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 3,
            },
            "prompt_lookup_min=4 must be <= prompt_lookup_max=3",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "/d"}, "takes no model"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a model directory"),
        (
            {
                "method": "draft_model",
                "model": "/d",
                "num_speculative_tokens": 2,
                "prompt_lookup_max": 3,
            },
            "prompt_lookup_max is for method 'ngram' only",
        ),
    ],
)
def test_mistakes_are_errors_that_name_them(value: Any, needle: str) -> None:
    with pytest.raises(ValueError, match=r"^speculative_config") as info:
        SpeculativeConfig.parse(value)
    assert needle in str(info.value)
    with pytest.raises(ValueError, match=r"^speculative_config"):  # at EngineConfig, the same
        EngineConfig(model="/m", speculative_config=value)


def test_engine_config_keeps_the_dict_and_parses_it() -> None:
    config = EngineConfig(
        model="/m", speculative_config={"method": "ngram", "num_speculative_tokens": 4}
    )
    assert config.speculative == SpeculativeConfig(
        method="ngram", num_speculative_tokens=4, prompt_lookup_min=5, prompt_lookup_max=5
    )
    assert EngineConfig(model="/m").speculative is None

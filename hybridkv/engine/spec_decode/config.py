"""SpeculativeConfig: how drafts are proposed, under vLLM's names, validated up front.

    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_min": 2, "prompt_lookup_max": 5})
    LLM(model, speculative_config={"method": "draft_model", "model": "path/to/draft",
                                   "num_speculative_tokens": 4})

``hybridkv serve|generate|bench --speculative-config JSON`` takes the same object as JSON.
Defaults are vLLM's: ngram without lookup sizes uses 5 and 5; one size given sets both;
``{"model": DIR}`` without a method is a draft model. Unknown keys and methods are errors
that name them (vLLM rejects them too), so a typo never silently turns speculation off.
Torch-free: :class:`~hybridkv.engine.config.EngineConfig` (which the CLI reads for its
flags) validates through it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default for both sizes ("arbitrarily chosen" there too)
KEYS = frozenset(
    {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"}
)


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """A validated speculative-decoding setup.

    Attributes:
        method: "ngram" (drafts copied from the sequence itself) or "draft_model" (a
            smaller model with the same vocabulary proposes them).
        num_speculative_tokens: draft tokens verified per step and sequence, at most (k).
        prompt_lookup_min: ngram: shortest suffix that must match earlier in the sequence.
        prompt_lookup_max: ngram: longest suffix tried first.
        model: draft_model: the draft's checkpoint directory.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config method must be one of {list(METHODS)}, got {self.method!r}"
            )
        _positive("num_speculative_tokens", self.num_speculative_tokens)
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config method 'ngram' takes no model")
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                _positive(name, getattr(self, name))
            assert self.prompt_lookup_min is not None and self.prompt_lookup_max is not None
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(
                    f"speculative_config prompt_lookup_min={self.prompt_lookup_min} must be "
                    f"<= prompt_lookup_max={self.prompt_lookup_max}"
                )
            return
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("speculative_config method 'draft_model' needs a model directory")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, name) is not None:
                raise ValueError(f"speculative_config {name} is for method 'ngram' only")

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any]) -> SpeculativeConfig:
        """A config from vLLM's dict form (defaults filled in as vLLM fills them).

        Raises:
            ValueError: not a dict, an unknown key, or a bad value (the message names it).
        """
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        unknown = sorted(set(value) - KEYS)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown keys {unknown} (known: {sorted(KEYS)})"
            )
        options = dict(value)
        method = options.pop("method", None)
        if method is None:
            if options.get("model") is None:
                raise ValueError("speculative_config needs a method ('ngram' or 'draft_model')")
            method = "draft_model"
        if "num_speculative_tokens" not in options:
            raise ValueError("speculative_config needs num_speculative_tokens")
        if method == "ngram":
            low, high = options.get("prompt_lookup_min"), options.get("prompt_lookup_max")
            if low is None and high is None:
                low = high = DEFAULT_PROMPT_LOOKUP
            options["prompt_lookup_min"] = high if low is None else low
            options["prompt_lookup_max"] = low if high is None else high
        return cls(method=method, **options)

    def to_dict(self) -> dict[str, Any]:
        """The vLLM dict form, only the keys that apply (stats, logs, the server's config)."""
        out: dict[str, Any] = {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
        }
        if self.method == "ngram":
            out["prompt_lookup_min"] = self.prompt_lookup_min
            out["prompt_lookup_max"] = self.prompt_lookup_max
        else:
            out["model"] = self.model
        return out


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"speculative_config {name} must be a positive integer, got {value!r}")

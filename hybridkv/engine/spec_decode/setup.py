"""Building speculation into an engine: the cache spec (with a draft model's layers) and
the :class:`Speculator` with its proposer.

A draft model is checked at start: its vocabulary must be the target's (same size and, when
both checkpoints have a tokenizer, the same token of every id), otherwise its guesses
would be ids of other tokens; a clear error says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hybridkv.core.spec import ModelSpec, with_draft
from hybridkv.engine.config import EngineConfig, loader_cache_dtype
from hybridkv.engine.spec_decode.config import SpeculativeConfig
from hybridkv.engine.spec_decode.draft_model import DraftModelProposer
from hybridkv.engine.spec_decode.ngram import NgramDrafts, NgramProposer
from hybridkv.engine.spec_decode.speculator import ROW_COST, Speculator
from hybridkv.models.loader import LoadedModel, load_model

if TYPE_CHECKING:
    from hybridkv.core.manager import CacheManager
    from hybridkv.engine.runner import ModelRunner

DEFAULT_DRAFT_LEN = 4096  # positions of a draft model whose config names none


@dataclass
class SpeculativeSetup:
    """What speculation adds to an engine (nothing when ``config`` is None)."""

    config: SpeculativeConfig | None
    cache_spec: ModelSpec  # the target's, with the draft model's layers after them
    target: LoadedModel
    draft: LoadedModel | None = None

    @classmethod
    def load(
        cls, engine: EngineConfig, target: LoadedModel, weight_limit: int | None = None
    ) -> SpeculativeSetup:
        """Load the draft model, if any, and check it against the target.

        ``weight_limit``: the bytes all the weights may take (the target's load was given
        it, :func:`hybridkv.engine.startup.weight_memory_limit`); the draft's fp32 matmul
        copies must fit in what the target's weights left of it.

        Raises:
            ValueError: the draft model's vocabulary is not the target's.
        """
        config = engine.speculative
        if config is None or config.method != "draft_model":
            return cls(config, target.spec, target)
        assert config.model is not None
        draft = load_model(  # the target's cache dtypes: one arena, one set of options
            config.model,
            dtype=target.dtype,
            device=engine.device,
            kv_dtype=loader_cache_dtype(engine.kv_cache_dtype),
            ssm_dtype=loader_cache_dtype(engine.mamba_ssm_cache_dtype),
            pack_weights=engine.pack_weights,
            matmul_dtype=engine.cpu_matmul_dtype,
            weight_memory_limit=None if weight_limit is None else weight_limit - target.nbytes,
        )
        check_vocabulary(target, draft, config.model)
        return cls(config, with_draft(target.spec, draft.spec), target, draft)

    @property
    def config_dict(self) -> dict[str, object] | None:
        return self.config.to_dict() if self.config else None

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens if self.config else 0

    def speculator(self, manager: CacheManager, runner: ModelRunner) -> Speculator | None:
        config = self.config
        if config is None:
            return None
        k = config.num_speculative_tokens
        if self.draft is None:
            assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
            ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, k)
            return Speculator(NgramDrafts(ngram), k, cost_per_draft=ROW_COST)
        draft_model = self.draft.model.to(runner.device)
        proposer = DraftModelProposer(
            draft_model,
            runner.views.renumbered(self.target.spec.num_layers),
            [g for g in self.cache_spec.groups if g.is_draft],
            manager,
            runner.device,
            int(self.draft.config.get("max_position_embeddings") or DEFAULT_DRAFT_LEN),
        )
        # the cost fit's prior: every draft token costs one draft forward on top of its
        # verified row (then measured, draft forwards included)
        relative = _num_params(draft_model) / max(1, _num_params(runner.model))
        return Speculator(proposer, k, cost_per_draft=ROW_COST + relative)


def check_vocabulary(target: LoadedModel, draft: LoadedModel, draft_dir: str) -> None:
    """Raises ValueError unless ``draft`` speaks the target's token ids."""
    sizes = int(target.config.get("vocab_size") or 0), int(draft.config.get("vocab_size") or 0)
    if sizes[0] != sizes[1]:
        raise ValueError(
            f"speculative_config model {draft_dir}: vocab_size {sizes[1]} differs from the "
            f"target's {sizes[0]}; a draft model must share the target's vocabulary"
        )
    if target.tokenizer is None or draft.tokenizer is None:
        return
    ours = target.tokenizer.backend.get_vocab(with_added_tokens=True)
    theirs = draft.tokenizer.backend.get_vocab(with_added_tokens=True)
    if ours != theirs:
        differ = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda kv: kv[1])[:3]
        raise ValueError(
            f"speculative_config model {draft_dir}: its tokenizer maps tokens to other ids "
            f"than the target's (e.g. {differ}); a draft model must share the vocabulary"
        )


def _num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())

"""model_type -> model class. Add an architecture by adding its module and one line here."""

from __future__ import annotations

from hybridkv.models.bamba import BambaForCausalLM
from hybridkv.models.base import CausalLM
from hybridkv.models.falcon_h1 import FalconH1ForCausalLM
from hybridkv.models.granitemoehybrid import GraniteMoeHybridForCausalLM
from hybridkv.models.jamba import JambaForCausalLM
from hybridkv.models.lfm2 import Lfm2ForCausalLM, Lfm2MoeForCausalLM
from hybridkv.models.nemotron_h import NemotronHForCausalLM
from hybridkv.models.qwen3_5 import Qwen35ForCausalLM, Qwen35MoeForCausalLM
from hybridkv.models.qwen3_next import Qwen3NextForCausalLM
from hybridkv.models.zamba2 import Zamba2ForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "qwen3_next": Qwen3NextForCausalLM,
    "qwen3_5": Qwen35ForCausalLM,
    "qwen3_5_text": Qwen35ForCausalLM,
    "qwen3_5_moe": Qwen35MoeForCausalLM,
    "qwen3_5_moe_text": Qwen35MoeForCausalLM,
    "lfm2": Lfm2ForCausalLM,
    "lfm2_moe": Lfm2MoeForCausalLM,
    "jamba": JambaForCausalLM,
    "falcon_h1": FalconH1ForCausalLM,
    "bamba": BambaForCausalLM,
    "nemotron_h": NemotronHForCausalLM,
    "granitemoehybrid": GraniteMoeHybridForCausalLM,
    "zamba2": Zamba2ForCausalLM,
}


def model_class(model_type: str) -> type[CausalLM]:
    """The class serving ``model_type``.

    Raises:
        ValueError: no architecture is registered for it.
    """
    try:
        return MODEL_CLASSES[model_type]
    except KeyError:
        known = ", ".join(sorted(MODEL_CLASSES))
        raise ValueError(f"no model for model_type {model_type!r} (known: {known})") from None

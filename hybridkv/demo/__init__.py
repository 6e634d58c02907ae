"""The embedded demo model: the checkpoint shipped in ``checkpoint/`` (package data), and
the recipe that makes it: the corpus (``corpus``), training through the serving model code
(``train``) and the build (``build``, also ``python -m hybridkv.demo.build``).

This module itself imports nothing heavy, so the CLI can find the shipped checkpoint
without loading torch.
"""

from __future__ import annotations

from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parent / "checkpoint"
COMPLETE_MARKER = "hybridkv_demo.json"
CHECKPOINT_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)


def is_complete(model_dir: Path) -> bool:
    """The directory holds a finished build (the marker is written last)."""
    return all((Path(model_dir) / name).is_file() for name in (*CHECKPOINT_FILES, COMPLETE_MARKER))


def shipped_demo_dir() -> Path:
    """The demo checkpoint shipped with the package.

    Raises:
        ValueError: it is missing (an install without package data): rebuild it with
            ``python -m hybridkv.demo.build``.
    """
    if not is_complete(SHIPPED_DIR):
        raise ValueError(
            f"the demo checkpoint is missing from {SHIPPED_DIR} (an install without package "
            f"data?); rebuild it with: python -m hybridkv.demo.build"
        )
    return SHIPPED_DIR


__all__ = ["CHECKPOINT_FILES", "COMPLETE_MARKER", "SHIPPED_DIR", "is_complete", "shipped_demo_dir"]

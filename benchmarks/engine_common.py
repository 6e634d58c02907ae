"""What the engine benchmarks share: the tiny checkpoint they build, and the machine line.

The checkpoint is the test suite's tiny random Qwen3.5 (``tests/models/tiny.py``: Gated
DeltaNet + gated attention, byte tokenizer), built with transformers into a temp dir,
so a benchmark needs no download and compares against the very model it loaded.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def build_tiny_checkpoint(
    model_dir: Path, model_type: str = "qwen3_5_text", **overrides: Any
) -> tuple[Any, Path]:
    """(transformers model, checkpoint dir) of the tests' tiny random ``model_type``, with
    ``overrides`` of its config."""
    sys.path.insert(0, str(ROOT / "tests" / "models"))
    from tiny import make_hf_model, save_checkpoint

    model = make_hf_model(model_type, **overrides)
    return model, save_checkpoint(model, model_dir)


def machine_line() -> str:
    """CPU, core count, load and torch threads: CPU timings mean little without them."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    cpu = platform.processor() or platform.machine()
    return (
        f"{cpu}, {os.cpu_count()} cores, load average {load:.1f}, "
        f"torch {torch.__version__} with {torch.get_num_threads()} thread(s)"
    )

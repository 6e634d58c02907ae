"""Torch modules over a flat token batch: ``forward(x [T, hidden], batch, views)`` for mixers.

Parameter names follow the Hugging Face checkpoints (``q_proj``, ``conv1d.weight``, ...) so a
model can load its state dict by name; see ``hybridkv.models.loader``.
"""

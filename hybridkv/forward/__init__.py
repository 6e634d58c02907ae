"""The engine ↔ model contract: what one step hands the layers.

- ``batch``: :class:`ForwardBatch`, the flat request-major tokens, page tables and state
  pages of one step.
- ``views``: :class:`CacheViews`, typed per-layer tensors over the one uint8 arena.

Layers and models import these; the engine builds them. Nothing here knows a layer kind's
math, and nothing here allocates cache memory.
"""

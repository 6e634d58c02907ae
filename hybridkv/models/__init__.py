"""Models: one file per architecture family, the flat ForwardBatch, cache views, the loader.

Entry points: :func:`hybridkv.models.loader.load_model`, ``model.forward(batch, views)``.
"""

"""Models: one file per architecture family, shared builders, the loader and the tokenizer.

Engine contract (one step)::

    lm = load_model(model_dir, dtype="bfloat16")       # LoadedModel(model, spec, tokenizer, config)
    layout = build_layout(lm.spec.groups, block_tokens, memory_bytes)
    views = CacheViews(lm.spec, layout, arena)         # arena: flat uint8 [layout.total_bytes]
    logits = lm.model(batch, views)                    # [R, vocab] fp32, rows = logits_indices

``ForwardBatch`` (:mod:`hybridkv.forward.batch`) is request-major: ``block_tables`` keyed by
attention group id (page ids, -1 allowed where never read), ``state_pages`` keyed by
recurrent group id (the live page; the model reads and writes the state there in place),
``has_initial_state`` False for a fresh state page. Snapshots and restores are page copies
the engine does on the arena between steps; the model never allocates cache memory.

Adding an architecture: subclass :class:`.base.CausalLM` (build ``self.model`` with
``build_model(layers, norm)``; layers are called ``layer(x [T, H], batch, views)``, and
:mod:`.common` has the attention config, the pre-norm layer and the hybrid layer loop),
override ``remap_weight_name`` / ``split_weight`` when checkpoint names differ, and add the
model_type to :mod:`.registry`. Mixers look up their cache with ``views.attn(i)`` or
``views.state(i)`` and the page ids with ``view.group_id``.
"""

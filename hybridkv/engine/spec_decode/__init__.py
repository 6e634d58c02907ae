"""Speculative decoding: drafts proposed cheaply, verified by the model in one forward.

``config`` (torch-free: the CLI reads it) validates vLLM's ``speculative_config``;
``ngram`` and ``draft_model`` propose draft tokens; ``rejection`` turns a verification
forward's logits into the accepted tokens (exact for greedy, distribution-preserving
rejection sampling otherwise); ``speculator`` decides per sequence how many drafts to ask
for (acceptance-driven fallback) and keeps the statistics; ``setup`` builds it all for an
engine. docs/architecture.md, "Speculative decoding", has the design.
"""

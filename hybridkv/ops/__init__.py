"""Ops: a plain-torch reference per op (``<op>/naive.py``), dispatched in ``<op>/__init__.py``.

The recurrent ops (causal conv1d, gated delta rule, Mamba2 SSD, Mamba1 scan) also have a
varlen path (``<op>/paged.py: *_varlen``) that runs a whole step's requests in one call on
their state pages, with in-forward state captures; :mod:`hybridkv.ops.paged_state` is
what they share. Fast kernel paths are optional and load only when their package is
installed; the naive version is the specification that every other path is tested against.
"""

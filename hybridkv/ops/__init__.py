"""Ops: a plain-torch reference per op (``<op>/naive.py``), dispatched in ``<op>/__init__.py``.

Fast paths are optional and load only when their kernel package is installed; the naive
version is the specification that every fast path is tested against.
"""

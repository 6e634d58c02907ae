"""Byte units, defined once: budgets are given in GiB and reported in MiB or GiB."""

from __future__ import annotations

MIB = 1 << 20
GIB = 1 << 30

"""Flags generated from a config dataclass, so the command line never drifts from the API.

Every field of :class:`hybridkv.engine.config.EngineConfig` (and of the server's config)
becomes ``--field-name`` with the field's default and type; its help is the field's line in
the class docstring's ``Attributes`` section; its metadata may add ``choices``, ``aliases``
(more option strings), ``parse`` (the flag text to a value), ``metavar`` and ``cli=False``
(not a flag). Booleans on by default are ``--x/--no-x``, off by default ``--x``; ``dict``
fields take JSON.

A flag's default is the field's default, read from the dataclass, so it can never disagree
with the Python API's.
"""

from __future__ import annotations

import argparse
import json
import re
import types
import typing
from dataclasses import MISSING, Field, fields
from typing import Any


def field_docs(cls: type) -> dict[str, str]:
    """Each field's text in the ``Attributes:`` section of ``cls``'s docstring, one line."""
    doc = cls.__doc__ or ""
    section = doc.split("Attributes:", 1)[1] if "Attributes:" in doc else ""
    docs: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in section.splitlines():
        match = re.match(r"^ {8}(\w+): (.*)$", line)
        if match:
            current = docs.setdefault(match.group(1), [])
            current.append(match.group(2).strip())
        elif current is not None and line.startswith(" " * 12):
            current.append(line.strip())
        elif line.strip():
            current = None
    return {name: " ".join(parts) for name, parts in docs.items()}


def _base_type(hint: Any) -> Any:
    """``int | None`` -> int; other hints as they are."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return hint


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _parser_for(f: Field[Any], hint: Any) -> Any:
    if "parse" in f.metadata:
        parse = f.metadata["parse"]

        def checked(text: str) -> Any:
            try:
                return parse(text)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None

        checked.__name__ = parse.__name__
        return checked
    base = _base_type(hint)
    if typing.get_origin(base) is dict or base is dict:
        return _json_object
    return base if base in (int, float, str) else str


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_config_args(group: Any, cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of ``cls`` (those in ``skip`` and ``cli=False`` ones left out)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in fields(cls):
        if f.name in skip or not f.metadata.get("cli", True):
            continue
        names = [flag_name(f.name), *f.metadata.get("aliases", ())]
        default = None if f.default is MISSING else f.default
        text = docs.get(f.name, f"{cls.__name__}.{f.name}")
        if default not in (None, False):
            text = f"{text.rstrip('.')} (default: {default})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": text}
        if _base_type(hints[f.name]) is bool:  # --x/--no-x unless off by default: --x
            action = "store_true" if default is False else argparse.BooleanOptionalAction
            group.add_argument(*names, action=action, **kwargs)
            continue
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        if "metavar" in f.metadata:
            kwargs["metavar"] = f.metadata["metavar"]
        group.add_argument(*names, type=_parser_for(f, hints[f.name]), **kwargs)


def config_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of ``cls`` found in the parsed ``args``."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in vars(args).items() if k in names}


__all__ = ["add_config_args", "config_values", "field_docs", "flag_name"]

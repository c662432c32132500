"""Typed message schemas: a class per message kind, checked field by field on decode.

A message class is a slotted dataclass registered under a kind string with `@message("kind")`.
On the wire it is a msgpack array `[kind, field1, field2, ...]` in declaration order, which is
compact and cheap to build on the hot path. `decode` refuses anything that is not exactly a known
kind with the right number of fields of the right types, naming the offending field.

Field annotations may be: int, float, str, bytes, bool, dict, list, Any, `list[T]`, `T | None`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from .errors import COMMAND_INVALID, SYNTAX_ERROR, ProtocolError

REGISTRY: dict[str, type] = {}

_NAMES = {int: "integer", float: "float", str: "string", bytes: "binary", bool: "boolean",
          dict: "map", list: "array"}


def _checker(tp):
    """Return (check(value) -> bool, description) for a type annotation."""
    if tp is Any:
        return (lambda v: True), "any"
    if tp is int:
        return (lambda v: type(v) is int), "integer"
    if tp is float:
        return (lambda v: type(v) in (float, int)), "float"
    if tp is bool:
        return (lambda v: type(v) is bool), "boolean"
    if tp in (str, bytes, dict, list):
        return (lambda v, tp=tp: isinstance(v, tp)), _NAMES[tp]
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (types.UnionType, typing.Union) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        check, desc = _checker(inner[0]) if len(inner) == 1 else _union(inner)
        return (lambda v: v is None or check(v)), f"{desc} or nil"
    if origin in (types.UnionType, typing.Union):
        return _union(args)
    if origin is list:
        (item_check, item_desc) = _checker(args[0])
        return (lambda v: isinstance(v, list) and all(map(item_check, v))), f"array of {item_desc}"
    raise TypeError(f"unsupported field type {tp!r}")


def _union(args):
    checks = [_checker(a) for a in args]
    return (lambda v: any(c(v) for c, _ in checks)), " or ".join(d for _, d in checks)


def message(kind: str):
    """Class decorator: make a slotted dataclass and register it under `kind`."""

    def deco(cls):
        cls = dataclasses.dataclass(slots=True)(cls)
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)
        cls.KIND = kind
        cls._fields = tuple(f.name for f in fields)
        cls._checks = tuple((f.name, *_checker(hints[f.name])) for f in fields)
        if kind in REGISTRY:
            raise ValueError(f"message kind {kind!r} registered twice")
        REGISTRY[kind] = cls
        return cls

    return deco


def to_wire(msg) -> list:
    """The msgpack-ready array for a message."""
    return [msg.KIND, *[getattr(msg, name) for name in msg._fields]]


def decode(value, allowed: frozenset[str] | None = None):
    """Turn a decoded msgpack value into a message object, or raise ProtocolError.

    `allowed` limits which kinds are acceptable here (e.g. only the handshake reply)."""
    if not isinstance(value, list) or not value or not isinstance(value[0], str):
        raise ProtocolError(SYNTAX_ERROR, "a message must be an array starting with its kind (a string)")
    kind = value[0]
    cls = REGISTRY.get(kind)
    if cls is None:
        raise ProtocolError(COMMAND_INVALID, f"unknown message kind {kind[:64]!r}")
    if allowed is not None and kind not in allowed:
        if kind == "error" and len(value) == 3:
            raise ProtocolError(value[1] if type(value[1]) is int else COMMAND_INVALID, str(value[2]))
        raise ProtocolError(COMMAND_INVALID, f"message {kind!r} is not allowed here")
    checks = cls._checks
    if len(value) - 1 != len(checks):
        raise ProtocolError(
            SYNTAX_ERROR, f"message {kind!r} needs {len(checks)} fields, got {len(value) - 1}"
        )
    for (name, check, desc), v in zip(checks, value[1:]):
        if not check(v):
            raise ProtocolError(
                SYNTAX_ERROR, f"message {kind!r}: field {name!r} must be {desc}, got {type(v).__name__}"
            )
    return cls(*value[1:])

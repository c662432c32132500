"""Typed message schemas: a class per message kind, validated in C on decode (msgspec).

A message class subclasses `Message` with its kind as the tag, `class Hello(Message,
tag="hello")`, and lists its fields with type annotations. On the wire it is a msgpack array
`[kind, field1, field2, ...]` in declaration order: compact, and cheap to build on the hot path.
Decoding refuses anything that is not exactly a known kind with the right number of fields of
the right types, and the error names the kind and the offending field.

msgspec does the work (a well-kept C library: decoding a batch of publishes is about twice as
fast as msgpack plus a field-by-field check in Python); this module keeps the error messages
ours.
"""

from __future__ import annotations

import re
import typing

import msgpack
import msgspec

from .errors import COMMAND_INVALID, SYNTAX_ERROR, ProtocolError

REGISTRY: dict[str, type] = {}


class Message(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Base of every message kind. `KIND` is the tag; `_fields` the field names in order."""

    KIND: typing.ClassVar[str] = ""
    _fields: typing.ClassVar[tuple] = ()


def register(cls):
    """Class decorator: record a Message subclass under its tag."""
    kind = cls.__struct_config__.tag
    if not isinstance(kind, str):
        raise TypeError(f"{cls.__name__} needs a string tag")
    if kind in REGISTRY:
        raise ValueError(f"message kind {kind!r} registered twice")
    cls.KIND = kind
    cls._fields = cls.__struct_fields__
    REGISTRY[kind] = cls
    _decoder.cache_clear()
    return cls


_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode  # a message -> its msgpack bytes


def to_wire(msg) -> list:
    """The msgpack-ready array for a message (for tests and generic code)."""
    return msgspec.to_builtins(msg, builtin_types=(bytes, bytearray))


class _Decoders:
    def __init__(self):
        self._dec = None
        self._union = None

    def cache_clear(self):
        self._dec = None
        self._union = None

    def get(self):
        if self._dec is None:
            self._union = typing.Union[tuple(REGISTRY.values())]  # noqa: UP007
            self._dec = msgspec.msgpack.Decoder(self._union)
        return self._dec, self._union


_decoder = _Decoders()

_AT = re.compile(r"- at `\$\[(\d+)\]")


def _explain(err: Exception, value) -> ProtocolError:
    """Turn msgspec's validation error into ours, naming the kind and the field."""
    text = str(err)
    if not isinstance(value, list) or not value or not isinstance(value[0], str):
        return ProtocolError(SYNTAX_ERROR, "a message must be an array starting with its kind (a string)")
    kind = value[0]
    cls = REGISTRY.get(kind)
    if cls is None:
        return ProtocolError(COMMAND_INVALID, f"unknown message kind {kind[:64]!r}")
    if len(value) - 1 != len(cls._fields):
        return ProtocolError(SYNTAX_ERROR,
                             f"message {kind!r} needs {len(cls._fields)} fields, got {len(value) - 1}")
    where = _AT.search(text)
    if where and 1 <= int(where.group(1)) <= len(cls._fields):
        name = cls._fields[int(where.group(1)) - 1]
        detail = text[:where.start()].strip().rstrip("-").strip()
        return ProtocolError(SYNTAX_ERROR, f"message {kind!r}: field {name!r}: {detail}")
    return ProtocolError(SYNTAX_ERROR, f"message {kind!r}: {text}")


def _check_allowed(msg, allowed):
    if allowed is not None and msg.KIND not in allowed:
        if msg.KIND == "error":
            raise ProtocolError(msg.code, msg.text)
        raise ProtocolError(COMMAND_INVALID, f"message {msg.KIND!r} is not allowed here")
    return msg


def decode_bytes(data, allowed: frozenset[str] | None = None):
    """One frame body (msgpack bytes) -> a message object, or ProtocolError."""
    dec = _decoder._dec
    if dec is None:
        dec = _decoder.get()[0]
    try:
        msg = dec.decode(data)
    except msgspec.ValidationError as exc:
        try:
            value = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception:  # noqa: BLE001 - the frame layer has already checked it decodes
            value = None
        if allowed is not None and isinstance(value, list) and value and value[0] in REGISTRY \
                and value[0] not in allowed:
            # a kind that has no business here: say that, not what is wrong with its fields
            raise ProtocolError(COMMAND_INVALID, f"message {value[0]!r} is not allowed here") from None
        raise _explain(exc, value) from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(SYNTAX_ERROR, f"frame body is not valid msgpack ({exc})") from None
    return msg if allowed is None else _check_allowed(msg, allowed)


def decode(value, allowed: frozenset[str] | None = None):
    """A decoded msgpack value -> a message object, or ProtocolError (tests, generic code).

    `allowed` limits which kinds are acceptable here (e.g. only the handshake reply)."""
    _, union = _decoder.get()
    try:
        msg = msgspec.convert(value, union)
    except msgspec.ValidationError as exc:
        raise _explain(exc, value) from None
    return _check_allowed(msg, allowed)

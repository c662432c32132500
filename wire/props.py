"""Message properties in the two forms a queue holds them, and the conversions between them.

A message's `props` item is one of:
* None: no properties (warren's client, nothing set);
* a dict: warren's client form, pika's names (`content_type`, `headers`, `delivery_mode`,
  `type`, `timestamp` in seconds, ...), values as msgpack carries them;
* a list `[exchange, routing_key, raw]`: published over AMQP 0-9-1; `raw` is the content header's
  property bytes (flags and property list) exactly as the publisher encoded them. They are
  carried through queues, mirrors and failovers untouched, so an AMQP consumer gets every
  property and every header's AMQP field type back as published (a 32-bit float stays one),
  as RabbitMQ does.

Across protocols the values are converted with pamqp (the AMQP codec): an AMQP message read by
warren's client gets a dict (decimals as text, timestamps as seconds, byte arrays as bytes), and
a warren-client message read over AMQP gets its dict encoded as AMQP properties (values that
have no AMQP form are left out rather than failing the delivery).
"""

from __future__ import annotations

import datetime
import struct

from pamqp import commands, header

BASIC_CLASS = 60
NO_PROPS = b"\x00\x00"  # a property list with no flag set
USER_ID_FLAG = commands.Basic.Properties.flags["user_id"]
HEADERS_FLAG = commands.Basic.Properties.flags["headers"]
_PREFIX = struct.Struct(">HHQ")
# pika's names <-> pamqp's (pamqp says message_type for AMQP's "type")
NATIVE_NAMES = {"message_type": "type"}
AMQP_NAMES = {"type": "message_type"}
PROPERTY_NAMES = tuple(commands.Basic.Properties.__slots__)


def decode_raw(raw: bytes) -> commands.Basic.Properties:
    """The property bytes of a content header, decoded by pamqp (ValueError if malformed)."""
    ch = header.ContentHeader()
    try:
        ch.unmarshal(_PREFIX.pack(BASIC_CLASS, 0, 0) + raw)
    except (struct.error, ValueError, TypeError, KeyError, IndexError, UnicodeDecodeError) as exc:
        raise ValueError(f"malformed content header properties: {exc}") from None
    return ch.properties


def _plain(value):
    """An AMQP field value msgpack can carry."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, bytearray):
        return bytes(value)
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=datetime.timezone.utc)
        return int(value.timestamp())
    if value.__class__.__name__ == "Decimal":
        return str(value)
    return value


def raw_to_dict(raw: bytes) -> dict | None:
    """AMQP property bytes -> warren's client form (None when nothing is set)."""
    if raw == NO_PROPS:
        return None
    try:
        props = decode_raw(raw)
    except ValueError:
        return None
    out = {}
    for name in PROPERTY_NAMES:
        v = getattr(props, name)
        if v is None or (name == "cluster_id" and v == ""):
            continue
        out[NATIVE_NAMES.get(name, name)] = _plain(v)
    return out or None


def _amqp_value(value):
    """A msgpack value as pamqp encodes it in a table (bytes as a byte array); None when it has
    no AMQP form."""
    if isinstance(value, dict):
        return {str(k): v for k, v in ((k, _amqp_value(v)) for k, v in value.items())
                if v is not None or value[k] is None}
    if isinstance(value, (list, tuple)):
        return [_amqp_value(v) for v in value]
    if isinstance(value, bytes):
        return bytearray(value)
    if value is None or isinstance(value, (bool, int, float, str, bytearray, datetime.datetime)):
        return value
    return None


def dict_to_raw(d: dict | None) -> bytes:
    """warren's client form -> AMQP property bytes (unknown names and values with no AMQP form
    are left out)."""
    if not d:
        return NO_PROPS
    kwargs = {}
    for name, v in d.items():
        name = AMQP_NAMES.get(name, name)
        if name not in PROPERTY_NAMES or v is None or name == "cluster_id":
            continue
        if name == "timestamp" and isinstance(v, (int, float)) and not isinstance(v, bool):
            v = datetime.datetime.fromtimestamp(v, datetime.timezone.utc)
        elif name == "headers":
            v = _amqp_value(v) if isinstance(v, dict) else None
        if v is not None:
            kwargs[name] = v
    try:
        return commands.Basic.Properties(**kwargs).marshal()
    except (TypeError, ValueError, struct.error, OverflowError):
        pass
    good = {}
    for name, v in kwargs.items():  # keep what encodes on its own
        try:
            commands.Basic.Properties(**{name: v}).marshal()
        except (TypeError, ValueError, struct.error, OverflowError):
            continue
        good[name] = v
    return commands.Basic.Properties(**good).marshal()


def with_reply_to(item, reply_to: str):
    """A props item whose reply_to is `reply_to` (direct reply-to's rewrite). AMQP property
    bytes are changed in place of that one field, so every other property and header keeps
    the type it was published with."""
    if item is None:
        return {"reply_to": reply_to}
    if isinstance(item, dict):
        return {**item, "reply_to": reply_to}
    raw = item[2]
    flags = raw[0] << 8 | raw[1]
    pos = 2
    # the fields before reply_to (bits 15..10): two short strings, a table, two octets and
    # a short string
    for bit, size in ((15, 1), (14, 1), (13, 4), (12, 0), (11, 0), (10, 1)):
        if flags & (1 << bit):
            if size == 0:
                pos += 1
            else:
                n = int.from_bytes(raw[pos:pos + size], "big")
                pos += size + n
    new = reply_to.encode()[:255]
    field = bytes([len(new)]) + new
    if flags & (1 << 9):
        end = pos + 1 + raw[pos]
        raw = raw[:pos] + field + raw[end:]
    else:
        flags |= 1 << 9
        raw = bytes([flags >> 8, flags & 0xFF]) + raw[2:pos] + field + raw[pos:]
    return [item[0], item[1], raw]


def to_native(item):
    """A props item as warren's client reads it."""
    if item is None or isinstance(item, dict):
        return item
    return raw_to_dict(item[2])


def native_list(props: list | None) -> list | None:
    """A batch's props for warren's client: AMQP items converted, the rest untouched."""
    if props is None:
        return None
    if any(isinstance(p, (list, tuple)) for p in props):
        return [to_native(p) for p in props]
    return props


def to_raw(item) -> bytes:
    """A props item as AMQP property bytes."""
    if item is None:
        return NO_PROPS
    if isinstance(item, dict):
        return dict_to_raw(item)
    return item[2]


def headers_of(item) -> dict | None:
    """The headers table of a props item (decoded only when it has one)."""
    if item is None:
        return None
    if isinstance(item, dict):
        h = item.get("headers")
        return h if isinstance(h, dict) else None
    raw = item[2]
    if len(raw) < 2 or not (raw[0] << 8 | raw[1]) & HEADERS_FLAG:
        return None
    try:
        return decode_raw(raw).headers
    except ValueError:
        return None


def routing_of(item, queue: str) -> tuple[str, str]:
    """(exchange, routing key) a message was published with; warren's client publishes to the
    default exchange with the queue's name."""
    if item is None or isinstance(item, dict):
        return "", queue
    return item[0], item[1]


PRIORITY_FLAG = commands.Basic.Properties.flags["priority"]
DELIVERY_MODE_FLAG = commands.Basic.Properties.flags["delivery_mode"]
_SHORTSTR_FLAGS = (commands.Basic.Properties.flags["content_type"],
                   commands.Basic.Properties.flags["content_encoding"])


def priority_of(item) -> int:
    """The `priority` property of a props item (0 when it has none). AMQP property bytes are
    read in place: the octet follows the two short strings, the headers table and the
    delivery mode that may come before it, so nothing is decoded."""
    if item is None:
        return 0
    if isinstance(item, dict):
        p = item.get("priority")
        return p if type(p) is int and p > 0 else 0
    raw = item[2]
    if len(raw) < 2:
        return 0
    flags = raw[0] << 8 | raw[1]
    if not flags & PRIORITY_FLAG:
        return 0
    at = 2
    try:
        for flag in _SHORTSTR_FLAGS:
            if flags & flag:
                at += 1 + raw[at]
        if flags & HEADERS_FLAG:
            at += 4 + int.from_bytes(raw[at:at + 4], "big")
        if flags & DELIVERY_MODE_FLAG:
            at += 1
        return raw[at]
    except IndexError:
        return 0


# a reply_to asking for direct reply-to: the node puts the requesting channel's address in its place
REPLY_TO = "amq.rabbitmq.reply-to"


def expiration_ms(value) -> int | str:
    """A message's `expiration` property as milliseconds, or RabbitMQ's text for a bad one.
    AMQP carries it as a string of digits; warren's client may give the string or an int."""
    text = str(value)
    try:
        ms = int(text, 10)
    except ValueError:
        return f"invalid expiration '{text}': no_integer"
    if ms < 0:
        return f"invalid expiration '{text}': {{value_negative,{ms}}}"
    return ms

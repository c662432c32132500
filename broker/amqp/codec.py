"""AMQP 0-9-1 frames on pamqp: splitting the byte stream into frames, decoding methods and
content headers, encoding what the server sends. Sans-IO.

pamqp (the codec) encodes and decodes every method, property list and field table. The hot
path keeps pamqp's per-frame cost off each message (pamqp's `frame.unmarshal` of a publish is
about 12 microseconds, its `marshal` of a delivery about 13):
* a `basic.publish` whose argument bytes were seen before reuses pamqp's decoding of them (a
  publisher repeats exchange and routing key), and a content header's property bytes are
  decoded by pamqp once per distinct value (bounded caches);
* `basic.ack` / `basic.nack` / `basic.reject` arguments are read with pamqp's field decoders;
* a delivery's method frame is assembled from fields pamqp encoded (the consumer tag, exchange
  and routing key once per value, the delivery tag with pamqp's struct), its header frame
  carries the publisher's property bytes as they came, and a body is split into frames of the
  negotiated size; a batch of deliveries is one loop and one byte string per message.
tests/test_amqp_codec.py checks these byte for byte against pamqp's own `frame.marshal` and
`frame.unmarshal`.
"""

from __future__ import annotations

import struct

from pamqp import commands, common, constants, decode, encode, exceptions, frame

from wire.props import NO_PROPS

METHOD = constants.FRAME_METHOD
HEADER = constants.FRAME_HEADER
BODY = constants.FRAME_BODY
HEARTBEAT = constants.FRAME_HEARTBEAT
FRAME_END = constants.FRAME_END
FRAME_END_CHAR = constants.FRAME_END_CHAR
FRAME_MIN = constants.FRAME_MIN_SIZE
PROTOCOL_HEADER = constants.AMQP + bytes((0, *constants.VERSION))
FRAME_HEAD = struct.Struct(">BHI")  # type, channel, payload size (pamqp.frame.frame_parts)
OVERHEAD = FRAME_HEAD.size + 1  # header and frame-end octet around every payload
_INDEX = struct.Struct(">I")
CONTENT = _CONTENT = struct.Struct(">HHQ")  # class id, weight, body size
CACHE_LIMIT = 1024

PUBLISH = commands.Basic.Publish.index
ACK = commands.Basic.Ack.index
NACK = commands.Basic.Nack.index
REJECT = commands.Basic.Reject.index
_DELIVER_INDEX = _INDEX.pack(commands.Basic.Deliver.index)
_RETURN_INDEX = _INDEX.pack(commands.Basic.Return.index)
_GET_OK_INDEX = _INDEX.pack(commands.Basic.GetOk.index)
HEARTBEAT_FRAME = frame.marshal(frame.heartbeat.Heartbeat(), 0)


class CodecError(Exception):
    """The bytes are not AMQP: `code` says which connection error (501 frame, 502 syntax,
    503 command invalid)."""

    def __init__(self, code: int, text: str):
        super().__init__(text)
        self.code = code
        self.text = text


# --- decoding ----------------------------------------------------------------------------------

def method_name(index: int) -> str:
    cls = commands.INDEX_MAPPING.get(index)
    if cls is None:
        return f"class {index >> 16} method {index & 0xFFFF}"
    name = cls.name
    if name.endswith("Ok"):
        name = name[:-2] + "-Ok"
    return name.lower()


def decode_method(payload: bytes):
    """A method frame's payload -> a pamqp method object."""
    if len(payload) < 4:
        raise CodecError(502, "method frame shorter than its class and method ids")
    index = _INDEX.unpack_from(payload)[0]
    cls = commands.INDEX_MAPPING.get(index)
    if cls is None:
        raise CodecError(503, f"unknown method ({method_name(index)})")
    whole = FRAME_HEAD.pack(METHOD, 0, len(payload)) + payload + FRAME_END_CHAR
    try:
        return frame.unmarshal(whole)[2]
    except (exceptions.UnmarshalingException, ValueError, TypeError, struct.error,
            UnicodeDecodeError, IndexError, KeyError) as exc:
        raise CodecError(502, f"cannot decode {cls.name}: {exc}") from None


class PublishCache:
    """basic.publish argument bytes -> (exchange, routing key, mandatory, immediate)."""

    def __init__(self):
        self._seen: dict[bytes, tuple] = {}

    def decode(self, payload: bytes) -> tuple:
        hit = self._seen.get(payload)
        if hit is not None:
            return hit
        method = decode_method(payload)
        hit = (method.exchange, method.routing_key, bool(method.mandatory), bool(method.immediate))
        if len(self._seen) >= CACHE_LIMIT:
            self._seen.clear()
        self._seen[payload] = hit
        return hit


def decode_ack(payload: bytes) -> tuple[int, bool, bool]:
    """basic.ack / basic.nack / basic.reject -> (delivery tag, multiple, requeue), read with
    pamqp's field decoders (ack: requeue False; reject: multiple False)."""
    index = _INDEX.unpack_from(payload)[0]
    try:
        _, tag = decode.long_long_int(payload[4:12])
        if index == REJECT:
            return tag, False, decode.bit(payload[12:13], 0)[1]
        multiple = decode.bit(payload[12:13], 0)[1]
        requeue = decode.bit(payload[12:13], 1)[1] if index == NACK else False
    except ValueError as exc:
        raise CodecError(502, f"cannot decode {method_name(index)}: {exc}") from None
    return tag, multiple, requeue


def content_header(payload: bytes) -> tuple[int, int, bytes]:
    """A content header frame's payload -> (class id, body size, property bytes)."""
    if len(payload) < 14:
        raise CodecError(502, "content header shorter than its fixed fields")
    class_id, _, size = _CONTENT.unpack_from(payload)
    return class_id, size, payload[12:]


# --- encoding ----------------------------------------------------------------------------------

def method_frame(method, channel: int) -> bytes:
    return frame.marshal(method, channel)


def _short(cache: dict, value: str) -> bytes:
    b = cache.get(value)
    if b is None:
        b = encode.short_string(value)
        if len(cache) >= CACHE_LIMIT:
            cache.clear()
        cache[value] = b
    return b


_shorts: dict[str, bytes] = {}
_long_long = encode.long_long_int
_tag = common.Struct.long_long_int.pack  # pamqp's encoding of a delivery tag (longlong)
_octet = encode.octet
_head = FRAME_HEAD.pack
_content = _CONTENT.pack


def content_frames(channel: int, body: bytes, raw: bytes, frame_max: int, out: list) -> None:
    """The header frame (the property bytes as they are) and the body frames of one message."""
    out.append(_head(HEADER, channel, 12 + len(raw)))
    out.append(_content(60, 0, len(body)))
    out.append(raw)
    out.append(FRAME_END_CHAR)
    n = len(body)
    if not n:
        return
    room = frame_max - OVERHEAD
    if n <= room:
        out.append(_head(BODY, channel, n))
        out.append(body)
        out.append(FRAME_END_CHAR)
        return
    for i in range(0, n, room):
        part = body[i:i + room]
        out.append(_head(BODY, channel, len(part)))
        out.append(part)
        out.append(FRAME_END_CHAR)


def deliver_batch(channel: int, consumer_tag: str, first_tag: int, bodies: list, redelivered,
                  props: list | None, queue: str, to_raw, frame_max: int, out: list) -> None:
    """The frames of a batch of deliveries to one consumer (tags first_tag, first_tag+1, ...;
    `redelivered` holds the indexes to flag). A message published over AMQP carries its
    exchange, routing key and property bytes (`[exchange, key, raw]`); any other is shown as
    published to the default exchange with the queue's name (`to_raw` gives its properties)."""
    pre = _DELIVER_INDEX + _short(_shorts, consumer_tag)
    head = _head
    content = _content
    tag = _tag
    end = FRAME_END_CHAR
    room = frame_max - OVERHEAD
    body_head = head(HEADER, channel, 12 + len(NO_PROPS))
    key = None
    post = mhead = b""
    for i, body in enumerate(bodies):
        item = props[i] if props is not None else None
        if item is None:
            ex, rk, raw = "", queue, NO_PROPS
        elif type(item) is list:
            ex, rk, raw = item
        else:
            ex, rk, raw = "", queue, to_raw(item)
        if (ex, rk) != key:
            key = (ex, rk)
            post = _short(_shorts, ex) + _short(_shorts, rk)
            mhead = head(METHOD, channel, len(pre) + 9 + len(post))
        n = len(body)
        hhead = body_head if raw is NO_PROPS or raw == NO_PROPS else head(HEADER, channel, 12 + len(raw))
        flag = b"\x01" if i in redelivered else b"\x00"
        if 0 < n <= room:
            out.append(b"".join((mhead, pre, tag(first_tag + i), flag, post, end, hhead,
                                 content(60, 0, n), raw, end, head(BODY, channel, n), body, end)))
        else:
            out.append(b"".join((mhead, pre, tag(first_tag + i), flag, post, end, hhead,
                                 content(60, 0, n), raw, end)))
            for j in range(0, n, room):
                part = body[j:j + room]
                out.append(head(BODY, channel, len(part)) + part + end)


def return_frames(channel: int, code: int, text: str, exchange: str, routing_key: str,
                  body: bytes, raw: bytes, frame_max: int, out: list) -> None:
    out.append(method_frame(commands.Basic.Return(code, text, exchange, routing_key), channel))
    content_frames(channel, body, raw or NO_PROPS, frame_max, out)


def get_ok_frames(channel: int, delivery_tag: int, redelivered: bool, exchange: str,
                  routing_key: str, message_count: int, body: bytes, raw: bytes, frame_max: int,
                  out: list) -> None:
    out.append(method_frame(commands.Basic.GetOk(delivery_tag, redelivered, exchange, routing_key,
                                                 message_count), channel))
    content_frames(channel, body, raw or NO_PROPS, frame_max, out)


class FrameReader:
    """Whole frames out of a byte stream. Raises CodecError for a frame larger than
    `frame_max` (before waiting for its bytes) or one that does not end with the frame-end
    octet."""

    def __init__(self, frame_max: int):
        self.frame_max = frame_max
        self._buf = b""

    def feed(self, data: bytes) -> list[tuple[int, int, bytes]]:
        buf = self._buf + data if self._buf else data
        out = []
        pos = 0
        end = len(buf)
        limit = self.frame_max - OVERHEAD
        unpack = FRAME_HEAD.unpack_from
        while end - pos >= 7:
            kind, channel, size = unpack(buf, pos)
            if size > limit:
                raise CodecError(501, f"frame of {size + OVERHEAD} bytes (type {kind}, channel "
                                      f"{channel}) is larger than frame_max {self.frame_max}")
            stop = pos + 7 + size
            if stop >= end:
                break
            if buf[stop] != FRAME_END:
                raise CodecError(501, f"frame (type {kind}, channel {channel}) does not end "
                                      f"with 0xCE but 0x{buf[stop]:02X}")
            out.append((kind, channel, buf[pos + 7:stop]))
            pos = stop + 1
        self._buf = buf[pos:] if pos < end else b""
        return out

    @property
    def buffered(self) -> int:
        return len(self._buf)

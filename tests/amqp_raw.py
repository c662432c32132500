"""A bare AMQP 0-9-1 client for tests that need what no client library gives: exact property
bytes on the wire (every field type of a headers table), and any bytes at all (the fuzz test).
Frames are encoded and decoded with pamqp; plain blocking sockets."""

from __future__ import annotations

import socket
import struct
import time

from pamqp import commands as C
from pamqp import frame, header

from broker.amqp import codec

CAPABILITIES = {"authentication_failure_close": True, "consumer_cancel_notify": True,
                "publisher_confirms": True, "basic.nack": True, "connection.blocked": True}


class Closed(Exception):
    pass


class RawClient:
    def __init__(self, port: int, user: str = "guest", password: str = "guest", *,
                 handshake: bool = True, timeout: float = 10.0, heartbeat: int = 0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = codec.FrameReader(1 << 20)
        self.pending: list = []
        self.eof = False
        if handshake:
            self.send(codec.PROTOCOL_HEADER)
            self.expect(C.Connection.Start)
            self.method(0, C.Connection.StartOk({"capabilities": CAPABILITIES, "product": "raw"},
                                                "PLAIN", f"\0{user}\0{password}"))
            tune = self.expect(C.Connection.Tune)
            self.frame_max = tune.frame_max
            self.method(0, C.Connection.TuneOk(tune.channel_max, tune.frame_max, heartbeat))
            self.method(0, C.Connection.Open("/"))
            self.expect(C.Connection.OpenOk)

    # --- bytes -----------------------------------------------------------------------------------
    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def method(self, ch: int, method) -> None:
        self.send(frame.marshal(method, ch))

    def frames(self, timeout: float) -> list[tuple[int, int, bytes]]:
        """Whatever frames arrive within `timeout` seconds (raw: type, channel, payload)."""
        out = self.pending
        self.pending = []
        if out:
            return out
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(1 << 20)
        except socket.timeout:
            return []
        except OSError:
            data = b""
        if not data:
            self.eof = True
            raise Closed("the server closed the connection")
        if data.startswith(b"AMQP"):
            return [(-1, 0, data[:8])] + self.reader.feed(data[8:])
        return self.reader.feed(data)

    def next(self, timeout: float = 10.0):
        """The next frame as (channel, pamqp object, payload)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no frame from the server")
            got = self.frames(left)
            if got:
                first, rest = got[0], got[1:]
                self.pending = rest + self.pending
                kind, ch, payload = first
                if kind == -1:
                    return ch, payload, payload
                whole = codec.FRAME_HEAD.pack(kind, ch, len(payload)) + payload + codec.FRAME_END_CHAR
                return ch, frame.unmarshal(whole)[2], payload

    def expect(self, cls, timeout: float = 10.0):
        ch, obj, _ = self.next(timeout)
        if not isinstance(obj, cls):
            raise AssertionError(f"expected {cls.__name__}, got {obj!r} "
                                 f"({getattr(obj, 'reply_text', '')})")
        return obj

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    # --- AMQP ------------------------------------------------------------------------------------
    def open_channel(self, ch: int = 1) -> None:
        self.method(ch, C.Channel.Open())
        self.expect(C.Channel.OpenOk)

    def publish(self, ch: int, exchange: str, key: str, body: bytes, raw_props: bytes) -> None:
        """basic.publish with the property bytes exactly as given."""
        self.send(publish_frames(ch, exchange, key, body, raw_props))

    def get(self, ch: int, queue: str, timeout: float = 10.0):
        """basic.get, no ack: (GetOk, raw property bytes, body) or None when empty."""
        self.method(ch, C.Basic.Get(0, queue, True))
        _, ok, _ = self.next(timeout)
        if isinstance(ok, C.Basic.GetEmpty):
            return None
        assert isinstance(ok, C.Basic.GetOk), ok
        _, hdr, payload = self.next(timeout)
        assert isinstance(hdr, header.ContentHeader), hdr
        body = b""
        while len(body) < hdr.body_size:
            _, part, _ = self.next(timeout)
            body += part.value
        return ok, payload[12:], body


def publish_frames(ch: int, exchange: str, key: str, body: bytes, raw_props: bytes = b"\0\0",
                   mandatory: bool = False) -> bytes:
    """The frames of one basic.publish (method, header with `raw_props`, body), to send alone
    or several in one write."""
    hdr = struct.pack(">HHQ", 60, 0, len(body)) + raw_props
    return (frame.marshal(C.Basic.Publish(0, exchange, key, mandatory), ch)
            + codec.FRAME_HEAD.pack(codec.HEADER, ch, len(hdr)) + hdr + codec.FRAME_END_CHAR
            + (frame.marshal(frame.body.ContentBody(body), ch) if body else b""))


# --- exact property bytes -------------------------------------------------------------------

def _short(s: str) -> bytes:
    b = s.encode()
    return bytes([len(b)]) + b


def _long(b: bytes) -> bytes:
    return struct.pack(">I", len(b)) + b


def every_field_type_table() -> bytes:
    """A headers table with one value of each AMQP field type RabbitMQ knows, written by hand so
    the exact type tags are on the wire (no client library writes all of them)."""
    items = [
        ("bool", b"t\x01"), ("int8", b"b" + struct.pack(">b", -5)), ("uint8", b"B\xfa"),
        ("int16", b"s" + struct.pack(">h", -300)), ("uint16", b"u" + struct.pack(">H", 60000)),
        ("int32", b"I" + struct.pack(">i", -70000)), ("uint32", b"i" + struct.pack(">I", 4000000000)),
        ("int64", b"l" + struct.pack(">q", -(2 ** 40))),
        ("float32", b"f" + struct.pack(">f", 1.5)), ("float64", b"d" + struct.pack(">d", 0.1)),
        ("decimal", b"D\x02" + struct.pack(">i", 12345)), ("string", b"S" + _long("héllo".encode())),
        ("array", b"A" + _long(b"I" + struct.pack(">i", 1) + b"S" + _long(b"two"))),
        ("timestamp", b"T" + struct.pack(">Q", 1700000000)),
        ("table", b"F" + _long(_short("inner") + b"t\x00")), ("void", b"V"),
        ("bytes", b"x" + _long(b"\x00\xff\x10")),
    ]
    body = b"".join(_short(k) + v for k, v in items)
    return _long(body)


def all_properties(user="guest") -> bytes:
    """All 14 basic properties set (flags 0xFFFC), in the spec's order."""
    return b"".join([
        struct.pack(">H", 0xFFFC), _short("application/json"), _short("gzip"), every_field_type_table(),
        b"\x02", b"\x07", _short("corr-1"), _short("reply-here"), _short("600000"), _short("msg-1"),
        struct.pack(">Q", 1700000001), _short("kind"), _short(user), _short("app"), _short("cluster-x"),
    ])

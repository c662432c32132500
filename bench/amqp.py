"""A lean AMQP 0-9-1 client for the load generator: an asyncio protocol over pamqp's codec.

The benchmark needs a client whose cost per message is small next to any broker's, so this is not
a general client: one `asyncio.Protocol` per connection (callbacks, no stream objects, no task or
future per message), one synchronous method at a time per channel, publisher confirms, consumers
with prefetch and acks, `connection.blocked`, heartbeats sent when negotiated.

pamqp encodes and decodes every frame, with two measured shortcuts on the hot path that stay
byte-for-byte pamqp's (tests/test_bench_amqp.py checks them against pamqp):

- sending: the method and content-header frames of a publish are marshalled by pamqp once per
  (channel, queue, body size), so a publish is that prefix + the body frame; an ack is pamqp's
  `Basic.Ack` frame with the delivery tag put in.
- receiving: frames are split on their 7-byte header here; `basic.deliver`, the content header
  of a delivery and the broker's `basic.ack`/`basic.nack` are read with `struct` straight from
  the buffer (their fields are fixed or length-prefixed); every other method goes to pamqp.

Writes made while a read is being handled (acks, a confirm-driven publish burst) are gathered and
sent in one `write` when the read is done, so a burst of deliveries costs one send for its acks.
"""

from __future__ import annotations

import asyncio
import socket
import struct

from pamqp import body as pbody
from pamqp import commands as C
from pamqp import frame as pframe
from pamqp import header as pheader
from pamqp import heartbeat as pheartbeat

FRAME_METHOD, FRAME_HEADER, FRAME_BODY, FRAME_HEARTBEAT = 1, 2, 3, 8
FRAME_END = 0xCE
_HEAD = struct.Struct(">BHI")          # frame type, channel, payload size
_INDEX = struct.Struct(">I")           # class id << 16 | method id
_U64 = struct.Struct(">Q")
_U64_BITS = struct.Struct(">QB")
DELIVER = C.Basic.Deliver.index
ACK = C.Basic.Ack.index
NACK = C.Basic.Nack.index
WRITE_HIGH = 1 << 20                   # pause producers above this much unsent data


class AMQPError(Exception):
    """The broker closed the connection or a channel, or the connection was lost."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code


def publish_frames(channel: int, queue: str, size: int, frame_max: int, exchange: str = "",
                   properties: C.Basic.Properties | None = None) -> tuple[bytes, bytes]:
    """(head, tail) such that head + the 8 first body bytes + tail is a whole publish of a body
    of `size` bytes whose bytes after the first 8 are zero. head is pamqp's method and header
    frames plus the first body frame's header; tail the rest of the body (split into frames of
    at most frame_max) and the frame ends."""
    if size < 8:
        raise ValueError("bodies carry an 8-byte id: size must be at least 8")
    method = pframe.marshal(C.Basic.Publish(exchange=exchange, routing_key=queue), channel)
    hdr = pframe.marshal(pheader.ContentHeader(0, size, properties or C.Basic.Properties()), channel)
    room = frame_max - 8 if frame_max else size  # payload of one body frame
    chunks = [min(room, size - k) for k in range(0, size, room)]
    first = pframe.marshal(pbody.ContentBody(bytes(chunks[0])), channel)
    head = method + hdr + first[:7]
    tail = first[7 + 8:]  # the first chunk's zeros after the id, and its frame end
    for n in chunks[1:]:
        tail += pframe.marshal(pbody.ContentBody(bytes(n)), channel)
    return head, tail


def ack_prefix(channel: int) -> bytes:
    """The bytes of pamqp's Basic.Ack frame on `channel` before its delivery tag."""
    tmpl = pframe.marshal(C.Basic.Ack(delivery_tag=0, multiple=False), channel)
    assert len(tmpl) == 7 + 4 + 9 + 1, tmpl
    return tmpl[:11]


def ack_frame(prefix: bytes, tag: int, multiple: bool) -> bytes:
    return prefix + _U64_BITS.pack(tag, 1 if multiple else 0) + b"\xce"


class Channel:
    """One channel: synchronous methods one at a time, confirms, deliveries, acks."""

    def __init__(self, conn: "Connection", number: int):
        self.conn = conn
        self.number = number
        self.is_open = False
        self.close_reason: str | None = None
        self._waiter: asyncio.Future | None = None
        self._expect: tuple = ()
        self._rpc_lock = asyncio.Lock()
        self.on_confirm = None      # (tag, multiple, ok) for the broker's acks and nacks
        self.on_delivery = None     # (delivery_tag, redelivered, body)
        self.on_close = None        # (reason) when the broker closes the channel
        self.on_cancel = None       # (consumer_tag) when the broker cancels a consumer
        self.returns = 0
        self._ack_prefix = ack_prefix(number)
        self._templates: dict = {}
        # a delivery being assembled: tag, redelivered, size, parts
        self._d_tag = 0
        self._d_red = False
        self._d_size = -1
        self._d_parts: list = []
        self._multi_tag = 0         # highest tag to ack with multiple=True at the end of the read
        self.auto_multiple = False

    # --- synchronous methods ------------------------------------------------------------------
    async def rpc(self, method, *replies):
        async with self._rpc_lock:
            if not self.is_open and not isinstance(method, C.Channel.Open):
                raise AMQPError(f"channel {self.number} is closed: {self.close_reason}")
            fut = self.conn.loop.create_future()
            self._waiter, self._expect = fut, replies
            self.conn.send(pframe.marshal(method, self.number))
            return await fut

    async def open(self) -> "Channel":
        self.is_open = True
        try:
            await self.rpc(C.Channel.Open(), C.Channel.OpenOk)
        except BaseException:
            self.is_open = False
            raise
        return self

    async def confirm_select(self) -> None:
        await self.rpc(C.Confirm.Select(), C.Confirm.SelectOk)

    async def basic_qos(self, prefetch_count: int, global_: bool = False) -> None:
        await self.rpc(C.Basic.Qos(prefetch_count=prefetch_count, global_=global_), C.Basic.QosOk)

    async def queue_declare(self, queue: str, durable: bool = False, arguments: dict | None = None,
                            exclusive: bool = False):
        """queue.declare; with queue "" the broker names the queue: declare-ok's `queue`."""
        return await self.rpc(C.Queue.Declare(queue=queue, durable=durable, exclusive=exclusive,
                                              arguments=arguments), C.Queue.DeclareOk)

    async def queue_delete(self, queue: str):
        return await self.rpc(C.Queue.Delete(queue=queue), C.Queue.DeleteOk)

    async def basic_consume(self, queue: str, no_ack: bool = False, tag: str = "") -> str:
        ok = await self.rpc(C.Basic.Consume(queue=queue, consumer_tag=tag, no_ack=no_ack), C.Basic.ConsumeOk)
        return ok.consumer_tag

    async def close(self) -> None:
        if self.is_open and not self.conn.is_closed:
            try:
                await self.rpc(C.Channel.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0),
                               C.Channel.CloseOk)
            except AMQPError:
                pass
        self.is_open = False

    # --- the hot path -------------------------------------------------------------------------
    def publish_template(self, queue: str, size: int) -> tuple[bytes, bytes]:
        key = (queue, size)
        t = self._templates.get(key)
        if t is None:
            t = self._templates[key] = publish_frames(self.number, queue, size, self.conn.frame_max)
        return t

    def ack(self, tag: int, multiple: bool = False) -> None:
        self.conn.send(self._ack_prefix + _U64_BITS.pack(tag, 1 if multiple else 0) + b"\xce")

    def ack_later(self, tag: int) -> None:
        """Ack everything up to `tag` with one multiple=True ack once the current read is handled."""
        if not self._multi_tag:
            self.conn.after_read.append(self)
        self._multi_tag = tag

    def flush_multiple(self) -> None:
        tag, self._multi_tag = self._multi_tag, 0
        if tag and self.is_open:
            self.ack(tag, True)

    # --- what the connection hands us ----------------------------------------------------------
    def _method(self, buf, start: int, end: int) -> None:
        index = _INDEX.unpack_from(buf, start)[0]
        if index == DELIVER:
            # consumer-tag shortstr, delivery-tag u64, redelivered bit, exchange, routing key
            p = start + 4
            p += 1 + buf[p]
            self._d_tag, bits = _U64_BITS.unpack_from(buf, p)
            self._d_red = bool(bits & 1)
            self._d_size = -1
            self._d_parts = []
            return
        if index == ACK or index == NACK:
            tag, bits = _U64_BITS.unpack_from(buf, start + 4)
            if self.on_confirm is not None:
                self.on_confirm(tag, bool(bits & 1), index == ACK)
            return
        self._other(pframe.unmarshal(bytes(buf[start - 7:end + 1]))[2])

    def _header(self, buf, start: int) -> None:
        # class u16, weight u16, body size u64, then the properties (not needed here)
        self._d_size = _U64.unpack_from(buf, start + 4)[0]
        if self._d_size == 0:
            self._delivered(b"")

    def _body(self, buf, start: int, end: int) -> None:
        if self._d_size < 0:
            return  # a body we were not told about (a basic.return's): ignore it
        if not self._d_parts and end - start == self._d_size:
            self._delivered(buf[start:end])
            return
        self._d_parts.append(bytes(buf[start:end]))
        got = sum(len(x) for x in self._d_parts)
        if got >= self._d_size:
            self._delivered(b"".join(self._d_parts))

    def _delivered(self, body) -> None:
        self._d_size = -1
        self._d_parts = []
        if self.on_delivery is not None:
            self.on_delivery(self._d_tag, self._d_red, body)

    def _other(self, method) -> None:
        if isinstance(method, C.Channel.Close):
            self.conn.send(pframe.marshal(C.Channel.CloseOk(), self.number))
            self._closed(f"{method.reply_code} {method.reply_text}", method.reply_code)
            return
        if isinstance(method, C.Channel.CloseOk):
            self.is_open = False
        if isinstance(method, C.Basic.Cancel):
            if self.on_cancel is not None:
                self.on_cancel(method.consumer_tag)
            return
        if isinstance(method, C.Basic.Return):
            self.returns += 1
            self._d_size = -2  # its header and body follow: skip them
            return
        w = self._waiter
        if w is not None and not w.done() and (not self._expect or isinstance(method, self._expect)):
            self._waiter = None
            w.set_result(method)

    def _closed(self, reason: str, code: int | None = None) -> None:
        self.is_open = False
        self.close_reason = reason
        w, self._waiter = self._waiter, None
        if w is not None and not w.done():
            w.set_exception(AMQPError(f"channel {self.number} closed: {reason}", code))
        if self.on_close is not None:
            self.on_close(reason)


class Connection(asyncio.Protocol):
    """One AMQP 0-9-1 connection (client side). Use `connect()`."""

    def __init__(self, user: str = "guest", password: str = "guest", vhost: str = "/",
                 heartbeat: int = 0, name: str = "warren-bench", frame_max: int = 131072):
        self.loop = asyncio.get_running_loop()
        self.user, self.password, self.vhost = user, password, vhost
        self.want_heartbeat = heartbeat
        self.heartbeat = 0
        self.name = name
        self.frame_max = frame_max
        self.channel_max = 2047
        self.transport: asyncio.Transport | None = None
        self.channels: dict[int, Channel] = {}
        self.opened: asyncio.Future = self.loop.create_future()
        self.closed: asyncio.Future = self.loop.create_future()
        self.is_closed = False
        self.close_reason: str | None = None
        self.server_properties: dict = {}
        self.blocked = False
        self.blocked_count = 0
        self.writable = asyncio.Event()
        self.writable.set()
        self.on_writable = None     # called when the transport's buffer drained again
        self.on_lost = None         # (reason) when the connection ends
        self._buf = b""
        self._out: list | None = None  # sends gathered while a read is handled
        self.after_read: list[Channel] = []
        self._hb_handle = None
        self._last_send = 0.0

    # --- set-up -------------------------------------------------------------------------------
    @classmethod
    async def connect(cls, host: str, port: int, timeout: float = 30.0, **kw) -> "Connection":
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(loop.create_connection(lambda: cls(**kw), host, port), timeout)
        try:
            await asyncio.wait_for(asyncio.shield(conn.opened), timeout)
        except BaseException:
            conn.abort()
            raise
        return conn

    async def channel(self) -> Channel:
        n = len(self.channels) + 1
        while n in self.channels:
            n += 1
        ch = Channel(self, n)
        self.channels[n] = ch
        return await ch.open()

    async def close(self, timeout: float = 5.0) -> None:
        if self.is_closed or self.transport is None:
            return
        self.send(pframe.marshal(C.Connection.Close(reply_code=200, reply_text="bye", class_id=0,
                                                   method_id=0), 0))
        try:
            await asyncio.wait_for(asyncio.shield(self.closed), timeout)
        except (asyncio.TimeoutError, AMQPError):
            pass
        self.abort()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # --- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.set_write_buffer_limits(high=WRITE_HIGH)
        transport.write(pheader.ProtocolHeader().marshal())

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()
        if self.on_writable is not None:
            self.on_writable()

    def connection_lost(self, exc) -> None:
        reason = self.close_reason or (f"connection lost: {exc}" if exc else "connection closed")
        self._finish(reason)

    def data_received(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        self._out = out = []
        off, n = 0, len(buf)
        try:
            while n - off >= 8:
                ftype, ch, size = _HEAD.unpack_from(buf, off)
                end = off + 7 + size
                if end >= n:
                    break
                if buf[end] != FRAME_END:
                    self._fail(f"bad frame end at a frame of type {ftype} on channel {ch}")
                    return
                start = off + 7
                off = end + 1
                channel = self.channels.get(ch) if ch else None
                if ftype == FRAME_BODY:
                    if channel is not None:
                        channel._body(buf, start, end)
                elif ftype == FRAME_METHOD:
                    if channel is not None:
                        channel._method(buf, start, end)
                    elif ch == 0:
                        self._connection_method(pframe.unmarshal(bytes(buf[start - 7:end + 1]))[2])
                elif ftype == FRAME_HEADER:
                    if channel is not None and channel._d_size == -1:
                        channel._header(buf, start)
                    elif channel is not None and channel._d_size == -2:
                        channel._d_size = -3  # a returned message's header: skip its body too
                # heartbeats need nothing: any frame shows the broker is alive
            self._buf = buf[off:] if off < n else b""
        finally:
            for ch in self.after_read:
                ch.flush_multiple()
            self.after_read.clear()
            self._out = None
            if out and self.transport is not None and not self.is_closed:
                self.transport.write(b"".join(out))
                self._last_send = self.loop.time()

    # --- sending ------------------------------------------------------------------------------
    def send(self, data: bytes) -> None:
        if self._out is not None:
            self._out.append(data)
        elif self.transport is not None and not self.is_closed:
            self.transport.write(data)
            self._last_send = self.loop.time()

    def send_many(self, parts: list) -> None:
        if self._out is not None:
            self._out.extend(parts)
        elif self.transport is not None and not self.is_closed:
            self.transport.write(b"".join(parts))
            self._last_send = self.loop.time()

    # --- connection class methods ---------------------------------------------------------------
    def _connection_method(self, m) -> None:
        if isinstance(m, C.Connection.Start):
            self.server_properties = m.server_properties or {}
            props = {"product": "warren-bench", "connection_name": self.name,
                     "capabilities": {"publisher_confirms": True, "consumer_cancel_notify": True,
                                      "basic.nack": True, "connection.blocked": True,
                                      "authentication_failure_close": True}}
            self.send(pframe.marshal(C.Connection.StartOk(
                client_properties=props, mechanism="PLAIN",
                response=f"\0{self.user}\0{self.password}", locale="en_US"), 0))
        elif isinstance(m, C.Connection.Tune):
            self.channel_max = min(x for x in (m.channel_max, self.channel_max) if x) if m.channel_max else self.channel_max
            self.frame_max = min(x for x in (m.frame_max, self.frame_max) if x) if m.frame_max else self.frame_max
            self.heartbeat = self.want_heartbeat if m.heartbeat else 0
            if self.want_heartbeat and m.heartbeat:
                self.heartbeat = min(self.want_heartbeat, m.heartbeat)
            self.send(pframe.marshal(C.Connection.TuneOk(channel_max=self.channel_max, frame_max=self.frame_max,
                                                         heartbeat=self.heartbeat), 0))
            self.send(pframe.marshal(C.Connection.Open(virtual_host=self.vhost), 0))
            if self.heartbeat:
                self._hb_handle = self.loop.call_later(self.heartbeat / 2, self._beat)
        elif isinstance(m, C.Connection.OpenOk):
            if not self.opened.done():
                self.opened.set_result(self)
        elif isinstance(m, C.Connection.Close):
            self.send(pframe.marshal(C.Connection.CloseOk(), 0))
            self.close_reason = f"closed by the broker: {m.reply_code} {m.reply_text}"
            self._finish(self.close_reason, m.reply_code)
            if self.transport is not None:
                self.loop.call_soon(self.transport.close)
        elif isinstance(m, C.Connection.CloseOk):
            self.close_reason = "closed"
            self._finish("closed")
            if self.transport is not None:
                self.transport.close()
        elif isinstance(m, C.Connection.Blocked):
            self.blocked = True
            self.blocked_count += 1
        elif isinstance(m, C.Connection.Unblocked):
            self.blocked = False

    def _beat(self) -> None:
        if self.is_closed:
            return
        if self.loop.time() - self._last_send >= self.heartbeat / 2:
            self.send(pheartbeat.Heartbeat().marshal())
        self._hb_handle = self.loop.call_later(self.heartbeat / 2, self._beat)

    def _fail(self, reason: str) -> None:
        self.close_reason = reason
        self._finish(reason)
        self.abort()

    def _finish(self, reason: str, code: int | None = None) -> None:
        if self.is_closed:
            return
        self.is_closed = True
        if self._hb_handle is not None:
            self._hb_handle.cancel()
        err = AMQPError(reason, code)
        if not self.opened.done():
            self.opened.set_exception(err)
            self.opened.exception()  # retrieved: no "never retrieved" warning
        for ch in list(self.channels.values()):
            if ch.is_open or ch._waiter is not None:
                ch._closed(reason, code)
        if not self.closed.done():
            self.closed.set_result(reason)
        self.writable.set()
        if self.on_lost is not None:
            self.on_lost(reason)


def parse_address(address: str, default_port: int = 5672) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host:
        return address, default_port
    return host, int(port)


async def open_channel(address: str, name: str = "warren-bench", **kw) -> tuple[Connection, Channel]:
    host, port = parse_address(address)
    conn = await Connection.connect(host, port, name=name, **kw)
    return conn, await conn.channel()

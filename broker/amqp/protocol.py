"""The AMQP 0-9-1 server side of one connection as a sans-IO state machine: bytes in, session
commands and events out; session outputs in, bytes out. No sockets, no clock (time comes in as
`now`), like h11's connection or hypercorn's protocol classes; broker/connection.py drives it
(broker/amqp/server.py). Its parts: this module (frames in: channels, content, the hot path of
publishes and acks), connection_level.py (channel 0: handshake, close, blocked, heartbeats),
output.py (the session's outputs as frames).

Connection (channel 0), as the spec and RabbitMQ do it:
    HEADER --"AMQP\\0\\0\\9\\1"--> START_OK --start-ok (PLAIN / AMQPLAIN, the users and the
    loopback rule)--> TUNE_OK --tune-ok--> OPEN --open "/"--> OPENED --close either way--> CLOSED
A wrong protocol header gets the server's header back and the connection ends. A connection
error (a broken frame, an unknown method, a frame on the wrong channel, content without its
header, a frame above frame_max, ...) sends `connection.close` with the code and RabbitMQ-like
text, then only `close-ok` (or `close`) is read. Heartbeats: `tick(now)` sends one when nothing
was sent for half the negotiated interval and fails the connection when nothing arrived for two.

Channels: `channel.open` first; methods become the session commands of wire/messages.py, each
synchronous one with a request id whose answer (`Reply`/`Fail`) becomes the right `-ok` method
(or nothing, with `nowait`). A channel the server closed reads nothing but `close-ok`. Content
is assembled per channel (method, header, bodies); consecutive publishes on one channel to one
exchange and routing key with one `mandatory` flag travel to the session as one `PublishTo`
batch (a change of flag starts a new batch: the flag is the batch's), consecutive acks as one
`Ack`. Properties stay as the publisher encoded them (wire/props.py); a `user_id` that is
not the connection's user closes the channel with 406, as RabbitMQ does.
"""

from __future__ import annotations

from pamqp import commands

from wire import messages as m
from wire import props as propsmod
from wire.errors import (CHANNEL_ERROR, COMMAND_INVALID, FRAME_ERROR, NOT_IMPLEMENTED,
                         PRECONDITION_FAILED, SYNTAX_ERROR, UNEXPECTED_FRAME, ProtocolError)

from ..frontend import ChannelFailed, Closed, ConnectionFailed, LoggedIn
from . import codec
from .connection_level import (SERVER_CHANNEL_MAX, SERVER_FRAME_MAX, SERVER_HEARTBEAT,
                               ConnectionPart, State)
from ..session.replyto import REPLY_TO
from .output import OutputPart

BATCH_BYTES = 1 << 20  # publishes gathered into one session command, at most (or one message:
# a batch crosses peer links in one frame, so a large message goes alone)
BATCH_MSGS = 2048
_PUBLISH_PREFIX = codec.PUBLISH.to_bytes(4, "big")

# the events for the driver (LoggedIn, ChannelFailed, ConnectionFailed, Closed) are
# broker/frontend.py's, shared with the native protocol


class _Channel:
    __slots__ = ("id", "closing", "close_sent", "method", "size", "raw", "parts", "got",
                 "consumers", "last_queue", "low", "ooo", "confirming", "ttl", "reply")

    def __init__(self, ch: int):
        self.id = ch
        self.closing = False  # the channel failed: read nothing but close-ok (and close)
        self.close_sent = False
        self.method: tuple | None = None  # a publish waiting for its content
        self.size = -1  # body size from the content header (-1: header not seen yet)
        self.raw = b""
        self.ttl: int | None = None  # the expiration (ms) of the publish whose content is read
        self.parts: list = []
        self.got = 0
        self.consumers: dict[str, str] = {}  # consumer tag -> queue
        self.last_queue = ""
        self.low = 1  # the lowest publish sequence number not confirmed yet
        self.ooo: set[int] = set()  # confirmed above `low`
        self.confirming = False
        self.reply = False  # the content being read asks for direct reply-to


class AmqpProtocol(ConnectionPart, OutputPart):
    """One connection's protocol state. `authenticate(mechanism, user, password)` raises
    ProtocolError to refuse a login; `has_vhost(name)` says whether that vhost exists;
    `enter_vhost(user, vhost)` raises ProtocolError (530 NOT_ALLOWED) at connection.open when the
    user has no permissions there; `can_open()` returns why the node refuses connections now
    (pause_minority), or "". It is a broker/frontend.py `ClientProtocol`."""

    NAME = "AMQP"
    SESSION_PROTOCOL = "AMQP 0-9-1"
    DEFAULT_CLIENT_NAME = "AMQP client"

    def __init__(self, *, authenticate, can_open=lambda: "", has_vhost=lambda name: name == "/",
                 enter_vhost=lambda user, vhost: None,
                 node: str = "", cluster: str = "",
                 heartbeat: int = SERVER_HEARTBEAT, frame_max: int = SERVER_FRAME_MAX,
                 channel_max: int = SERVER_CHANNEL_MAX, max_message: int = 128 << 20,
                 now: float = 0.0, version: str = "0.1.0"):
        self.authenticate = authenticate
        self.can_open = can_open
        self.has_vhost = has_vhost
        self.enter_vhost = enter_vhost
        self.vhost = "/"
        self.node = node
        self.cluster = cluster
        self.version = version
        self.state = State.HEADER
        self.server_heartbeat = heartbeat
        self.server_frame_max = frame_max
        self.server_channel_max = channel_max
        self.max_message = max_message
        self.heartbeat = 0
        self.frame_max = frame_max
        self.channel_max = channel_max
        self.user = ""
        self.mechanism = ""
        self.client_properties: dict = {}
        self.capabilities: dict = {}
        self.channels: dict[int, _Channel] = {}
        self.requests: dict[int, tuple] = {}  # rid -> (channel, kind, nowait, method index)
        self._rids = 0
        self._out: list[bytes] = []
        self._events: list = []
        self._batch: list | None = None  # [ch, exchange, key, mandatory, bodies, props, bytes, kind, ttl]
        self._publish = codec.PublishCache()
        # property bytes -> (their user_id, their expiration in ms or None)
        self._props_seen: dict[bytes, tuple] = {}
        self._header = b""
        self._rest = b""  # the start of a frame whose end has not arrived
        self.last_recv = now
        self.last_sent = now
        self.closing_since = 0.0
        self.blocked: dict[str, str] = {}  # why the server holds this connection: source -> reason
        self.reading = True  # False while the server holds the connection: no heartbeat check

    # --- bytes in ------------------------------------------------------------------------------
    def receive_data(self, data: bytes, now: float) -> list:
        """Feed bytes from the client; returns the session commands and events they make, in
        order."""
        self.last_recv = now
        if self.state is State.CLOSED or not data:
            return []
        if self.state is State.HEADER:
            self._header += data
            if len(self._header) < 8:
                return []
            data = self._header[8:]
            if not self._check_header(self._header[:8]):
                return self._take_events()
            self._header = b""
            if not data:
                return self._take_events()
        buf = self._rest + data if self._rest else data
        self._rest = b""
        pos, end = 0, len(buf)
        limit = self.frame_max - codec.OVERHEAD  # the server's until tune-ok, then the negotiated
        unpack = codec.FRAME_HEAD.unpack_from
        channels = self.channels
        opened = self.state is State.OPENED
        BODY, HEADER, METHOD, END = codec.BODY, codec.HEADER, codec.METHOD, codec.FRAME_END
        while end - pos >= 7:
            kind, ch, size = unpack(buf, pos)
            if size > limit:
                self._connection_error(FRAME_ERROR, f"frame of {size + codec.OVERHEAD} bytes (type "
                                                    f"{kind}, channel {ch}) is larger than frame_max "
                                                    f"{limit + codec.OVERHEAD}")
                return self._closing_events()
            stop = pos + 7 + size
            if stop >= end:
                break  # the rest of this frame is still on its way
            if buf[stop] != END:
                self._connection_error(FRAME_ERROR, f"frame (type {kind}, channel {ch}) does not "
                                                    f"end with 0xCE but 0x{buf[stop]:02X}")
                return self._closing_events()
            try:
                if opened and ch:
                    c = channels.get(ch)
                    if c is not None and not c.closing:
                        if c.method is None:
                            if kind == METHOD and buf[pos + 7:pos + 11] == _PUBLISH_PREFIX:
                                # the hot path: method, header and body of a publish, whole
                                nxt = self._whole_publish(c, buf, pos + 7, stop, end, limit)
                                if nxt:
                                    pos = nxt
                                    continue
                                self._on_publish(c, buf[pos + 7:stop])
                                pos = stop + 1
                                continue
                        elif kind == BODY and c.size >= 0:
                            c.parts.append(buf[pos + 7:stop])
                            c.got += size
                            pos = stop + 1
                            if c.got >= c.size:
                                if c.got > c.size:
                                    raise ProtocolError(FRAME_ERROR, f"content body on channel {ch} is "
                                                                     f"longer than the {c.size} bytes its "
                                                                     "header gave")
                                self._complete(c)
                            continue
                        elif kind == HEADER and c.size < 0:
                            pos = stop + 1
                            self._on_header(c, buf[pos - 1 - size:stop])
                            continue
                payload = buf[pos + 7:stop]
                pos = stop + 1
                if self.state is State.CLOSED:
                    break
                self._frame(kind, ch, payload, now)
                opened = self.state is State.OPENED
            except (codec.CodecError, ProtocolError) as exc:
                self._connection_error(exc.code, exc.text)
                opened = False
        if pos < end and self.state is not State.CLOSED:
            self._rest = buf[pos:]
        self._flush_batch()
        return self._take_events()

    def _closing_events(self) -> list:
        """A broken frame: nothing after it can be read (the close-ok will not be either)."""
        self._rest = b""
        self._flush_batch()
        return self._take_events()

    def _take_events(self) -> list:
        ev, self._events = self._events, []
        return ev

    def _frame(self, kind: int, ch: int, payload: bytes, now: float) -> None:
        state = self.state
        if kind == codec.HEARTBEAT:
            if ch != 0:
                raise ProtocolError(FRAME_ERROR, f"heartbeat frame on channel {ch}")
            return
        if kind not in (codec.METHOD, codec.HEADER, codec.BODY):
            raise ProtocolError(FRAME_ERROR, f"unknown frame type {kind} on channel {ch}")
        if state is State.CLOSING:
            if kind == codec.METHOD and ch == 0:
                method = codec.decode_method(payload)
                if isinstance(method, (commands.Connection.CloseOk, commands.Connection.Close)):
                    if isinstance(method, commands.Connection.Close):
                        self._method(0, commands.Connection.CloseOk())
                    self._finish("connection closed")
            return  # everything else is discarded while we close
        if state is not State.OPENED:
            self._handshake(kind, ch, payload, now)
            return
        if ch == 0:
            if kind != codec.METHOD:
                raise ProtocolError(CHANNEL_ERROR, "content frames on channel 0")
            self._connection_method(codec.decode_method(payload))
            return
        if ch > self.channel_max:
            raise ProtocolError(CHANNEL_ERROR, f"channel {ch} is above the negotiated channel_max "
                                               f"{self.channel_max}")
        c = self.channels.get(ch)
        if kind == codec.METHOD:
            index = int.from_bytes(payload[:4], "big") if len(payload) >= 4 else 0
            if c is not None and c.closing:
                if index in (commands.Channel.CloseOk.index, commands.Channel.Close.index):
                    if index == commands.Channel.Close.index:
                        self._method(ch, commands.Channel.CloseOk())
                    self._drop_channel(ch)
                return  # discarded until the client answers our channel.close
            if c is None:
                if index == commands.Channel.CloseOk.index:
                    return  # both sides closed at once; ours was answered already
                if index != commands.Channel.Open.index:
                    raise ProtocolError(CHANNEL_ERROR, f"expected 'channel.open' on channel {ch}, "
                                                       f"got '{codec.method_name(index)}'")
            if c is not None and c.method is not None:
                raise ProtocolError(UNEXPECTED_FRAME,
                                    f"expected content header for class 60 on channel {ch}, got "
                                    f"'{codec.method_name(index)}'")
            if index == codec.PUBLISH:
                self._on_publish(c, payload)
            elif index in (codec.ACK, codec.NACK, codec.REJECT):
                self._on_ack(c, index, payload)
            else:
                self._channel_method(ch, c, codec.decode_method(payload))
            return
        if c is None:
            raise ProtocolError(CHANNEL_ERROR, f"content frame on channel {ch}, which is not open")
        if c.closing:
            return
        if c.method is None:
            raise ProtocolError(UNEXPECTED_FRAME, f"content frame on channel {ch} with no "
                                                  "basic.publish before it")
        if kind == codec.HEADER:
            if c.size >= 0:
                raise ProtocolError(UNEXPECTED_FRAME, f"a second content header on channel {ch}")
            self._on_header(c, payload)
        else:
            if c.size < 0:
                raise ProtocolError(UNEXPECTED_FRAME, f"content body on channel {ch} before its "
                                                      "content header")
            c.parts.append(payload)
            c.got += len(payload)
            if c.got >= c.size:
                if c.got > c.size:
                    raise ProtocolError(FRAME_ERROR, f"content body on channel {ch} is longer "
                                                     f"than the {c.size} bytes its header gave")
                self._complete(c)

    # --- channel methods -----------------------------------------------------------------------
    def _rid(self, ch: int, kind: str, nowait: bool, index: int) -> int:
        self._rids += 1
        self.requests[self._rids] = (ch, kind, nowait, index)
        return self._rids

    def _command(self, cmd) -> None:
        self._flush_batch()
        self._events.append(cmd)

    def _channel_method(self, ch: int, c: _Channel | None, method) -> None:
        C = commands
        t = type(method)
        idx = method.index
        if t is C.Channel.Open:
            if c is not None:
                raise ProtocolError(CHANNEL_ERROR, f"second 'channel.open' seen on channel {ch}")
            self.channels[ch] = _Channel(ch)
            self._command(m.ChannelOpen(self._rid(ch, "channel.open", False, idx), ch))
        elif t is C.Channel.Close:
            self._command(m.ChannelClose(self._rid(ch, "channel.close", False, idx), ch))
        elif t is C.Channel.CloseOk:
            return  # not after a close of ours (that case is handled before): nothing to do
        elif t is C.Channel.Flow:
            self._command(m.ChannelFlow(self._rid(ch, "channel.flow", False, idx), ch, bool(method.active)))
        elif t is C.Channel.FlowOk:
            return  # warren never asks a client to stop publishing with channel.flow
        elif t is C.Basic.Qos:
            if method.prefetch_size:
                raise ProtocolError(NOT_IMPLEMENTED, f"prefetch_size!=0 ({method.prefetch_size})")
            self._command(m.BasicQos(self._rid(ch, "basic.qos", False, idx), ch,
                                     method.prefetch_count, bool(method.global_)))
        elif t is C.Basic.Consume:
            queue = method.queue or c.last_queue
            self._command(m.BasicConsume(self._rid(ch, "basic.consume:" + queue, method.nowait, idx),
                                         ch, method.queue, method.consumer_tag, bool(method.no_ack),
                                         bool(method.exclusive), _table(method.arguments)))
        elif t is C.Basic.Cancel:
            self._command(m.BasicCancel(self._rid(ch, "basic.cancel", method.nowait, idx), ch,
                                        method.consumer_tag))
        elif t is C.Basic.Get:
            queue = method.queue or c.last_queue
            self._command(m.BasicGet(self._rid(ch, "basic.get:" + queue, False, idx), ch,
                                     method.queue, bool(method.no_ack)))
        elif t is C.Basic.Recover or t is C.Basic.RecoverAsync:
            self._command(m.BasicRecover(self._rid(ch, "basic.recover", t is C.Basic.RecoverAsync, idx),
                                         ch, bool(method.requeue)))
        elif t is C.Confirm.Select:
            c.confirming = True
            self._command(m.ConfirmSelect(self._rid(ch, "confirm.select", method.nowait, idx), ch))
        elif t is C.Tx.Select:
            self._command(m.TxSelect(self._rid(ch, "tx.select", False, idx), ch))
        elif t is C.Tx.Commit:
            self._command(m.TxCommit(self._rid(ch, "tx.commit", False, idx), ch))
        elif t is C.Tx.Rollback:
            self._command(m.TxRollback(self._rid(ch, "tx.rollback", False, idx), ch))
        elif t is C.Exchange.Declare:
            self._command(m.ExchangeDeclare(
                self._rid(ch, "exchange.declare", method.nowait, idx), ch, method.exchange,
                method.exchange_type, bool(method.passive), bool(method.durable),
                bool(method.auto_delete), bool(method.internal), _table(method.arguments)))
        elif t is C.Exchange.Delete:
            self._command(m.ExchangeDelete(self._rid(ch, "exchange.delete", method.nowait, idx), ch,
                                           method.exchange, bool(method.if_unused)))
        elif t is C.Exchange.Bind:
            self._command(m.ExchangeBind(self._rid(ch, "exchange.bind", method.nowait, idx), ch,
                                         method.destination, method.source, method.routing_key,
                                         _table(method.arguments)))
        elif t is C.Exchange.Unbind:
            self._command(m.ExchangeUnbind(self._rid(ch, "exchange.unbind", method.nowait, idx), ch,
                                           method.destination, method.source, method.routing_key,
                                           _table(method.arguments)))
        elif t is C.Queue.Declare:
            self._command(m.QueueDeclare(
                self._rid(ch, "queue.declare", method.nowait, idx), ch, method.queue,
                bool(method.passive), bool(method.durable), bool(method.exclusive),
                bool(method.auto_delete), _table(method.arguments)))
        elif t is C.Queue.Bind:
            self._command(m.QueueBind(self._rid(ch, "queue.bind", method.nowait, idx), ch,
                                      method.queue, method.exchange, method.routing_key,
                                      _table(method.arguments)))
        elif t is C.Queue.Unbind:
            self._command(m.QueueUnbind(self._rid(ch, "queue.unbind", False, idx), ch, method.queue,
                                        method.exchange, method.routing_key, _table(method.arguments)))
        elif t is C.Queue.Purge:
            self._command(m.QueuePurge(self._rid(ch, "queue.purge", method.nowait, idx), ch, method.queue))
        elif t is C.Queue.Delete:
            self._command(m.QueueDelete(self._rid(ch, "queue.delete", method.nowait, idx), ch,
                                        method.queue, bool(method.if_unused), bool(method.if_empty)))
        else:
            raise ProtocolError(COMMAND_INVALID, f"'{codec.method_name(idx)}' is not a method a "
                                                 "client sends")

    # --- the hot path: publishes and acks ------------------------------------------------------
    def _on_publish(self, c: _Channel, payload: bytes) -> None:
        exchange, key, mandatory, immediate = self._publish.decode(payload)
        if immediate:
            raise ProtocolError(NOT_IMPLEMENTED, "immediate=true")
        c.method = (exchange, key, mandatory)
        c.size = -1
        c.parts = []
        c.got = 0

    def _on_header(self, c: _Channel, payload: bytes) -> None:
        class_id, size, raw = codec.content_header(payload)
        if class_id != 60:
            raise ProtocolError(UNEXPECTED_FRAME, f"content header for class {class_id} on channel "
                                                  f"{c.id}, expected class 60 (basic)")
        if not self._check_content(c, raw, size):
            return
        c.size = size
        c.raw = raw
        if size == 0:
            self._complete(c)

    def _whole_publish(self, c: _Channel, buf: bytes, mstart: int, mstop: int, end: int,
                       limit: int) -> int:
        """A publish whose header and body (one frame) are all in `buf`: handled at once.
        Returns where the next frame starts, or 0 when it is not that simple (the frame by frame
        path then takes it, with its errors)."""
        unpack = codec.FRAME_HEAD.unpack_from
        h = mstop + 1
        if end - h < 7:
            return 0
        hk, hch, hsize = unpack(buf, h)
        hstop = h + 7 + hsize
        if hk != codec.HEADER or hch != c.id or hsize > limit or hsize < 14 or hstop >= end \
                or buf[hstop] != codec.FRAME_END:
            return 0
        class_id, _, size = codec.CONTENT.unpack_from(buf, h + 7)
        if class_id != 60:
            return 0
        if size:
            b = hstop + 1
            if end - b < 7:
                return 0
            bk, bch, bsize = unpack(buf, b)
            nxt = b + 8 + bsize
            if bk != codec.BODY or bch != c.id or bsize != size or bsize > limit or nxt > end \
                    or buf[nxt - 1] != codec.FRAME_END:
                return 0
            body = buf[b + 7:nxt - 1]
        else:
            body = b""
            nxt = hstop + 1
        exchange, key, mandatory, immediate = self._publish.decode(buf[mstart:mstop])
        if immediate:
            raise ProtocolError(NOT_IMPLEMENTED, "immediate=true")
        raw = buf[h + 19:hstop]
        if not self._check_content(c, raw, size):
            return nxt
        self._add_publish(c.id, exchange, key, mandatory, body, raw, c.ttl, c.reply)
        return nxt

    def _check_content(self, c: _Channel, raw: bytes, size: int) -> bool:
        """The property bytes decode (pamqp, once per distinct value), user_id is the user's,
        the body is not too large; False when the channel failed. Sets the channel's `ttl` and
        `reply` (the message asks for direct reply-to) from the cached reading."""
        seen = self._props_seen
        if raw in seen:
            user_id, ttl, reply = seen[raw]
        else:
            try:
                props = propsmod.decode_raw(raw)
            except ValueError as exc:
                raise ProtocolError(SYNTAX_ERROR, f"{exc} on channel {c.id}") from None
            user_id = props.user_id
            ttl = props.expiration
            if ttl is not None:
                ttl = propsmod.expiration_ms(ttl)
                if type(ttl) is str:  # not cached: the channel fails
                    self._fail_channel(c, PRECONDITION_FAILED, ttl)
                    return False
            reply = props.reply_to == REPLY_TO
            if len(seen) >= codec.CACHE_LIMIT:
                seen.clear()
            seen[raw] = (user_id, ttl, reply)
        c.ttl = ttl
        c.reply = reply
        if user_id is not None and user_id != self.user:
            self._fail_channel(c, PRECONDITION_FAILED, f"user_id property set to '{user_id}' but "
                                                       f"authenticated user was '{self.user}'")
            return False
        if size > self.max_message:
            self._fail_channel(c, PRECONDITION_FAILED, f"message size {size} is larger than "
                                                       f"configured max size {self.max_message}")
            return False
        return True

    def _complete(self, c: _Channel) -> None:
        exchange, key, mandatory = c.method
        parts = c.parts
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        raw = c.raw
        c.method = None
        c.size = -1
        c.parts = []
        self._add_publish(c.id, exchange, key, mandatory, body, raw, c.ttl, c.reply)

    def _add_publish(self, ch: int, exchange: str, key: str, mandatory: bool, body: bytes,
                     raw: bytes, ttl: int | None, reply: bool) -> None:
        """One whole message into the batch of publishes going to the session (those asking
        for direct reply-to in batches of their own)."""
        item = None if (raw == propsmod.NO_PROPS and not exchange) else [exchange, key, raw]
        kind = "reply" if reply else "pub"
        if ttl is not None:
            # a message with an expiration goes alone: a batch carries one TTL to its queues
            self._flush_batch()
            self._batch = [ch, exchange, key, mandatory, [body], [item], len(body), kind, ttl]
            self._flush_batch()
            return
        b = self._batch
        if b is not None and (b[0] != ch or b[1] != exchange or b[2] != key or b[3] != mandatory
                              or b[6] + len(body) > BATCH_BYTES or len(b[4]) >= BATCH_MSGS
                              or b[7] != kind):
            self._flush_batch()
            b = None
        if b is None:
            self._batch = [ch, exchange, key, mandatory, [body], [item], len(body), kind, None]
        else:
            b[4].append(body)
            b[5].append(item)
            b[6] += len(body)

    def _on_ack(self, c: _Channel, index: int, payload: bytes) -> None:
        tag, multiple, requeue = codec.decode_ack(payload)
        kind = "ack" if index == codec.ACK else ("nack+" if requeue else "nack-")
        b = self._batch
        if b is None or b[0] != c.id or b[7] != kind:
            self._flush_batch()
            b = self._batch = [c.id, None, None, None, [], None, 0, kind, None]
        if multiple:
            # tag 0 with multiple: everything delivered so far
            b[6] = -1 if tag == 0 or b[6] == -1 else max(b[6], tag)
        else:
            b[4].append(tag)

    def _flush_batch(self) -> None:
        b = self._batch
        if b is None:
            return
        self._batch = None
        kind = b[7]
        if kind == "pub":
            props = b[5]
            if all(p is None for p in props):
                props = None
            self._events.append(m.PublishTo(b[0], b[1], b[2], b[3], b[4], props, b[8], False))
        elif kind == "reply":
            self._events.append(m.PublishTo(b[0], b[1], b[2], b[3], b[4], b[5], b[8], True))
        elif kind == "ack":
            self._events.append(m.Ack(b[0], b[4], b[6]))
        else:
            self._events.append(m.Nack(b[0], b[4], b[6], kind == "nack+"))

    def _drop_channel(self, ch: int) -> None:
        self._flush_batch()
        self.channels.pop(ch, None)
        for rid in [r for r, req in self.requests.items() if req[0] == ch]:
            del self.requests[rid]

    def _fail_channel(self, c: _Channel, code: int, text: str) -> None:
        self._flush_batch()
        c.method = None
        c.closing = True
        self._events.append(ChannelFailed(c.id, code, text))

def _table(value) -> dict:
    return value if isinstance(value, dict) else {}


__all__ = ["AmqpProtocol", "State", "LoggedIn", "ChannelFailed", "ConnectionFailed", "Closed"]

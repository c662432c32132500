"""The trio-native warren client.

    async with open_connection(["127.0.0.1:5672", "127.0.0.1:5673"]) as conn:
        ch = await conn.channel()
        await ch.queue_declare("jobs", durable=True)
        await ch.confirm_delivery()
        await ch.basic_publish("", "jobs", b"hello")
        await ch.wait_for_confirms()
        consumer = await ch.basic_consume("jobs")
        async for msg in consumer:
            ch.basic_ack(msg.delivery_tag)

Batching: publishes and acks are queued and coalesced by one writer task, so a burst becomes one
frame per queue. Reconnection: when the connection breaks the client tries the nodes in turn with
back-off, re-opens its channels, re-declares the exchanges and queues it declared (a server-named
queue gets a new name, which its bindings and consumers follow: see `events`), binds again what
it bound, re-creates its consumers and calls `on_reconnect(node)`. Publishes not yet confirmed
when the connection broke are reported as nacks with reason "connection lost", so the
application can publish them again. Delivery tags keep
increasing across reconnections; acks for tags of the old connection are dropped.

TLS: `open_connection(..., ssl_context=ctx)` with a client-side `ssl.SSLContext` (for instance
`broker.tls.client_context(cert, key, ca)`) talks TLS to a node's client port (`--tls-cert`).

Blocked connections: a node with a memory alarm (or in a cluster where a node has one) stops
reading from connections that publish and says so. The connection then has `blocked` True and
`blocked_reason` set, calls `on_blocked(reason)`, and records a ("blocked", reason) event; when
the alarm is over, `blocked` is False again, `on_unblocked()` runs and an ("unblocked", "") event
is recorded. `await conn.wait_unblocked()` waits for that. Publishes made meanwhile queue up in
the client until its send buffer is full, then `basic_publish` waits. Consume on a connection of
its own: a blocked connection's acks are not read either.
"""

from __future__ import annotations

import itertools
import math
import os
from collections import deque
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

import trio

from broker.backoff import Backoff
from broker.framed import DirectWrites, FramedStream, direct_socket, frame_parts
from broker.network import TcpNetwork
from wire import messages as m
from wire.errors import ProtocolError
from wire.frames import DEFAULT_MAX_FRAME
from wire.props import REPLY_TO

REFUSED = object()  # a recovery step the broker refused

from .errors import (AMQPConnectionError, ChannelClosed, ChannelClosedByBroker,
                     ConnectionClosedByBroker, ConnectionLost)

MAX_BATCH_MSGS = 2000
MAX_BATCH_BYTES = 1 << 20


def parse_nodes(nodes) -> list[tuple[str, int]]:
    if isinstance(nodes, str):
        nodes = nodes.split(",")
    out = []
    for n in nodes:
        if isinstance(n, tuple):
            out.append((n[0], int(n[1])))
            continue
        host, _, port = n.strip().rpartition(":")
        out.append((host or "127.0.0.1", int(port or 5672)) if port.isdigit() else (n.strip(), 5672))
    return out


@dataclass(slots=True)
class Message:
    delivery_tag: int
    body: bytes
    redelivered: bool
    properties: dict | None
    consumer_tag: str
    queue: str
    exchange: str = ""  # where it was published: the default exchange ("") and the queue's name,
    routing_key: str = ""  # unless it went through another exchange or with another key


@dataclass(slots=True)
class ReturnedMessage:
    """A mandatory message no queue took, as the node sent it back (AMQP's basic.return)."""
    reply_code: int
    reply_text: str
    exchange: str
    routing_key: str
    body: bytes
    properties: dict | None


@dataclass
class DeclareOk:
    queue: str
    message_count: int
    consumer_count: int


class _Writer:
    """Queue of outgoing messages; consecutive publishes (and acks) of one channel coalesce.

    What is queued goes out from one of two places, never both at once (broker/framed.py
    `DirectWrites`): the connection's writer task, or `flush()` straight from the task that
    queued it while the writer task is idle. A direct write is for a burst after which its task
    waits anyway: the acks a consumer's callbacks made, sent when the reader is about to wait
    (after the last of several reads in a row, as the writer task would have sent them, so they
    still leave together: a write after every read cut `all`'s throughput), or a producer's
    burst before it sleeps (`Connection.flush()`)."""

    def __init__(self):
        self.items: deque = deque()
        self.wake = trio.Event()
        self.bytes_queued = 0
        self.room = trio.Event()
        self.room.set()
        self._last_bytes = 0  # body bytes in the Publish batch at the tail of items
        self.direct = DirectWrites()  # its socket is set while the writer task runs
        self.max_frame = DEFAULT_MAX_FRAME
        self.holding = False  # the reader is handling a read: it sends what is queued before it waits

    def _queued(self) -> None:
        """A new item is queued: wake the writer task, unless the reader sends it later."""
        if not self.holding:
            self.wake.set()

    def put(self, msg) -> None:
        items = self.items
        t = type(msg)
        if t is m.Publish:
            n = sum(map(len, msg.bodies))
            batch = self._joinable(msg.ch, msg.queue, msg.props is not None) if items else None
            if batch is None:
                self._start_batch(msg, n)
                return
            batch.bodies.extend(msg.bodies)
            if msg.props is not None:
                batch.props.extend(msg.props)
            self._joined(n)
            return
        if t is m.Ack and items:
            last = items[-1]
            if type(last) is m.Ack and last.ch == msg.ch:
                last.tags.extend(msg.tags)
                last.multiple_upto = max(last.multiple_upto, msg.multiple_upto)
                return
        items.append(msg)
        self._queued()

    def put_body(self, ch: int, queue: str, body: bytes) -> None:
        """One publish without properties: `put(Publish(ch, queue, [body], None))` without
        building a message for it when it can join the Publish batch at the tail."""
        batch = self._joinable(ch, queue, False) if self.items else None
        if batch is None:
            self._start_batch(m.Publish(ch, queue, [body], None), len(body))
            return
        batch.bodies.append(body)
        self._joined(len(body))

    def put_ack(self, ch: int, tag: int) -> None:
        """One acked delivery tag: `put(Ack(ch, [tag], 0))` without building a message for it
        when the last queued item is an Ack of the same channel (a consumer that acks each
        message calls this once per message)."""
        items = self.items
        if items:
            last = items[-1]
            if type(last) is m.Ack and last.ch == ch:
                last.tags.append(tag)
                return
        items.append(m.Ack(ch, [tag], 0))
        self._queued()

    def _joinable(self, ch: int, queue: str, with_props: bool):
        """The Publish batch at the tail of a non-empty queue if a publish to `queue` on `ch`
        may join it (both with properties or both without, and the batch not full), else None."""
        last = self.items[-1]
        if type(last) is m.Publish and last.ch == ch and last.queue == queue \
                and (last.props is not None) == with_props \
                and len(last.bodies) < MAX_BATCH_MSGS and self._last_bytes < MAX_BATCH_BYTES:
            return last
        return None

    def _start_batch(self, msg, n: int) -> None:
        """`msg`, a Publish of `n` body bytes, becomes the batch at the tail."""
        self.items.append(msg)
        self._queued()
        self._last_bytes = 0
        self._joined(n)

    def _joined(self, n: int) -> None:
        """`n` body bytes joined the Publish batch at the tail."""
        self._last_bytes += n
        self.bytes_queued += n
        if self.bytes_queued > 8 * MAX_BATCH_BYTES and self.room.is_set():
            self.room = trio.Event()

    def take(self) -> list:
        """Everything queued, in order; the queue is then empty and has room again."""
        out = list(self.items)
        self.items.clear()
        self.bytes_queued = 0
        self.room.set()
        return out

    def flush(self) -> None:
        """Write what is queued now, straight to the socket, if the writer task is idle; what the
        socket does not take now (or everything, when a send is in flight or there is no socket)
        is left to the writer task."""
        if not self.items:
            return
        direct = self.direct
        if not direct.can_write() or direct.write(self.take_parts()):
            self.wake.set()

    def take_parts(self) -> list | None:
        """Everything queued, framed for one write (None if nothing is)."""
        return frame_parts(self.take(), self.max_frame) if self.items else None

    def drop(self) -> None:
        """The connection is gone: nothing queued or half-written will be sent on it."""
        self.take()
        self.direct.rest = []
        self.direct.sock = None


class Consumer:
    """An async iterator of Messages; ends when the consumer is cancelled."""

    def __init__(self, channel: "Channel", queue: str, tag: str, auto_ack: bool, exclusive: bool,
                 arguments: dict, callback):
        self.channel = channel
        self.queue = queue
        self.tag = tag
        self.auto_ack = auto_ack
        self.exclusive = exclusive
        self.arguments = arguments
        self.callback = callback
        self._send, self._recv = trio.open_memory_channel(math.inf)
        self.cancelled_reason: str | None = None
        self.on_cancel = None
        self._streak = 0

    def _deliver(self, msgs: list[Message]) -> None:
        if self.callback is not None:
            for msg in msgs:
                self.callback(self.channel, msg)
        else:
            for msg in msgs:
                self._send.send_nowait(msg)

    def _cancelled(self, reason: str) -> None:
        self.cancelled_reason = reason
        self._send.close()
        if self.on_cancel is not None:
            self.on_cancel(self, reason)

    def __aiter__(self):
        return self

    async def __anext__(self) -> Message:
        # Take already-received messages without yielding to the scheduler each time, so the
        # application's acks for a whole burst coalesce into one frame; yield every 256.
        self._streak += 1
        if self._streak < 256:
            try:
                return self._recv.receive_nowait()
            except trio.WouldBlock:
                pass
            except trio.EndOfChannel:
                raise StopAsyncIteration from None
        self._streak = 0
        try:
            return await self._recv.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    def get_nowait(self) -> Message | None:
        try:
            return self._recv.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            return None


class Channel:
    def __init__(self, conn: "Connection", ch: int):
        self.conn = conn
        self.ch = ch
        self.is_open = True
        self.close_reason: ChannelClosedByBroker | None = None
        self.prefetch = 0
        self.confirming = False
        self.next_seq = 1
        self.outstanding: dict[int, int] = {}  # first seq -> last seq of unconfirmed batches
        self._seq_base = 0  # server seq = local seq - _seq_base on the current connection
        self.nacked: list[tuple[int, int, str]] = []
        self.on_confirm = None  # callback(first, last, ok, reason)
        self._confirm_waiters: list[trio.Event] = []
        self.consumers: dict[str, Consumer] = {}
        self.tag_offset = 0  # app delivery tag = server tag + tag_offset
        self.max_tag = 0
        self.declared: dict[str, dict] = {}
        # exchanges declared and bindings made on this channel, made again after a reconnection
        # (before the queues are: bindings after them, as an exclusive queue's went with it)
        self.exchanges: dict[str, tuple] = {}
        self.bindings: list[tuple] = []  # (kind, destination, source, routing_key, arguments)
        # mandatory messages no queue took: given to on_return(channel, ReturnedMessage) if set,
        # else kept in `returned` (oldest first) for the application to take
        self.returned: list[ReturnedMessage] = []
        self.on_return = None
        self._early: dict[str, list] = {}
        # while the connection is being re-established, publishes wait here (with their
        # sequence numbers) until the channel is open and in confirm mode again
        self._held: list | None = None

    # --- helpers ---------------------------------------------------------------------------
    def _check(self):
        if not self.is_open:
            raise self.close_reason or ChannelClosed(f"channel {self.ch} is closed")

    async def _rpc(self, make):
        self._check()
        return await self.conn._rpc(make, self)

    # --- queues ----------------------------------------------------------------------------
    async def queue_declare(self, queue: str = "", passive: bool = False, durable: bool = False,
                            exclusive: bool = False, auto_delete: bool = False,
                            arguments: dict | None = None) -> DeclareOk:
        args = dict(arguments or {})
        value = await self._rpc(lambda rid: m.QueueDeclare(rid, self.ch, queue, passive, durable,
                                                           exclusive, auto_delete, args))
        if not passive:
            self.declared[value[0] if not queue else queue] = dict(
                durable=durable, exclusive=exclusive, auto_delete=auto_delete, arguments=args,
                server_named=not queue)
        return DeclareOk(*value)

    async def queue_delete(self, queue: str, if_unused: bool = False, if_empty: bool = False) -> int:
        self.declared.pop(queue, None)
        self.bindings = [b for b in self.bindings if not (b[0] == "queue" and b[1] == queue)]
        return await self._rpc(lambda rid: m.QueueDelete(rid, self.ch, queue, if_unused, if_empty))

    async def queue_purge(self, queue: str) -> int:
        return await self._rpc(lambda rid: m.QueuePurge(rid, self.ch, queue))

    # --- exchanges and bindings ------------------------------------------------------------
    async def exchange_declare(self, exchange: str, exchange_type: str = "direct", passive: bool = False,
                               durable: bool = False, auto_delete: bool = False, internal: bool = False,
                               arguments: dict | None = None) -> None:
        """Declare an exchange (direct, fanout, topic or headers), as AMQP's exchange.declare."""
        args = dict(arguments or {})
        await self._rpc(lambda rid: m.ExchangeDeclare(rid, self.ch, exchange, exchange_type, passive,
                                                      durable, auto_delete, internal, args))
        if not passive:
            self.exchanges[exchange] = (exchange_type, durable, auto_delete, internal, args)

    async def exchange_delete(self, exchange: str, if_unused: bool = False) -> None:
        await self._rpc(lambda rid: m.ExchangeDelete(rid, self.ch, exchange, if_unused))
        self.exchanges.pop(exchange, None)
        self.bindings = [b for b in self.bindings
                         if b[2] != exchange and not (b[0] == "exchange" and b[1] == exchange)]

    async def queue_bind(self, queue: str, exchange: str, routing_key: str | None = None,
                         arguments: dict | None = None) -> None:
        """Bind `queue` to `exchange` (routing_key None: the queue's name, as pika does)."""
        key = queue if routing_key is None else routing_key
        args = dict(arguments or {})
        await self._rpc(lambda rid: m.QueueBind(rid, self.ch, queue, exchange, key, args))
        self._bound("queue", queue, exchange, key, args)

    async def queue_unbind(self, queue: str, exchange: str, routing_key: str | None = None,
                           arguments: dict | None = None) -> None:
        key = queue if routing_key is None else routing_key
        args = dict(arguments or {})
        await self._rpc(lambda rid: m.QueueUnbind(rid, self.ch, queue, exchange, key, args))
        self._unbound("queue", queue, exchange, key, args)

    async def exchange_bind(self, destination: str, source: str, routing_key: str = "",
                            arguments: dict | None = None) -> None:
        """Messages `source` routes with a matching key go on to `destination` too."""
        args = dict(arguments or {})
        await self._rpc(lambda rid: m.ExchangeBind(rid, self.ch, destination, source, routing_key, args))
        self._bound("exchange", destination, source, routing_key, args)

    async def exchange_unbind(self, destination: str, source: str, routing_key: str = "",
                              arguments: dict | None = None) -> None:
        args = dict(arguments or {})
        await self._rpc(lambda rid: m.ExchangeUnbind(rid, self.ch, destination, source, routing_key, args))
        self._unbound("exchange", destination, source, routing_key, args)

    def _renamed(self, old: str, new: str) -> None:
        """A server-named queue got a new name at a reconnection."""
        self.declared[new] = self.declared.pop(old)
        self.bindings = [(b[0], new, *b[2:]) if b[0] == "queue" and b[1] == old else b
                         for b in self.bindings]
        for c in self.consumers.values():
            if c.queue == old:
                c.queue = new

    def _bound(self, *binding) -> None:
        if binding not in self.bindings:
            self.bindings.append(binding)

    def _unbound(self, *binding) -> None:
        if binding in self.bindings:
            self.bindings.remove(binding)

    async def basic_qos(self, prefetch_count: int = 0, global_qos: bool = False) -> None:
        await self._rpc(lambda rid: m.BasicQos(rid, self.ch, prefetch_count, global_qos))
        self.prefetch = prefetch_count

    # --- publishing ------------------------------------------------------------------------
    async def confirm_delivery(self) -> None:
        await self._rpc(lambda rid: m.ConfirmSelect(rid, self.ch))
        self.confirming = True

    async def tx_select(self) -> None:
        """Transaction mode: publishes and acks take effect at tx_commit."""
        await self._rpc(lambda rid: m.TxSelect(rid, self.ch))

    async def tx_commit(self) -> None:
        """Apply what was published and acked since the last commit; returns once every mirror
        of the queues involved has the messages."""
        await self._rpc(lambda rid: m.TxCommit(rid, self.ch))

    async def tx_rollback(self) -> None:
        await self._rpc(lambda rid: m.TxRollback(rid, self.ch))

    def publish_nowait(self, routing_key: str, body: bytes, properties: dict | None = None,
                       exchange: str = "", mandatory: bool = False) -> int | None:
        """Queue one message for sending; returns its sequence number in confirm mode. To the
        default exchange ("") it goes to the queue named `routing_key`; to another exchange
        it is routed by that exchange's bindings. `mandatory`: if no queue takes it, it comes
        back (`returned`, `on_return`) before its confirm."""
        self._check()
        seq = None
        if self.confirming:
            seq = self.next_seq
            self.next_seq += 1
            self.outstanding[seq] = seq
        if exchange or mandatory or (properties and properties.get("reply_to") == REPLY_TO):
            msg = m.PublishTo(self.ch, exchange, routing_key, mandatory, [bytes(body)],
                              None if properties is None else [properties], None, False)
        elif self._held is None and properties is None:
            self.conn._writer.put_body(self.ch, routing_key, bytes(body))
            return seq
        else:
            msg = m.Publish(self.ch, routing_key, [bytes(body)], None if properties is None else [properties])
        if self._held is not None:
            self._held.append((seq, msg))
        else:
            self.conn._put(msg)
        return seq

    async def basic_publish(self, exchange: str, routing_key: str, body: bytes,
                            properties: dict | None = None, mandatory: bool = False) -> int | None:
        """Publish one message (waits only if the send buffer is full); see publish_nowait."""
        await self.conn._room()
        return self.publish_nowait(routing_key, body, properties, exchange, mandatory)

    def _on_returned(self, msg: m.Returned) -> None:
        props = msg.props
        for i, body in enumerate(msg.bodies):
            back = ReturnedMessage(msg.code, msg.text, msg.exchange, msg.routing_key, body,
                                   props[i] if props is not None else None)
            if self.on_return is not None:
                self.on_return(self, back)
            else:
                self.returned.append(back)

    def _confirm(self, first: int, last: int, ok: bool, reason: str) -> None:
        out = self.outstanding
        local_first = first + self._seq_base
        local_last = last + self._seq_base
        if local_last - local_first < 64 or len(out) < (local_last - local_first):
            for s in range(local_first, local_last + 1):
                out.pop(s, None)
        else:
            for s in [s for s in out if local_first <= s <= local_last]:
                del out[s]
        if not ok:
            self.nacked.append((local_first, local_last, reason))
        if self.on_confirm is not None:
            self.on_confirm(local_first, local_last, ok, reason)
        if not out and self._confirm_waiters:
            for ev in self._confirm_waiters:
                ev.set()
            self._confirm_waiters.clear()

    async def wait_for_confirms(self, timeout: float | None = None) -> bool:
        """Wait until every publish so far is confirmed; True if none was nacked since last call.
        Raises the channel's close reason if the broker closed it with publishes unconfirmed."""
        if self.outstanding and self.is_open:
            ev = trio.Event()
            self._confirm_waiters.append(ev)
            if timeout is None:
                await ev.wait()
            else:
                with trio.fail_after(timeout):
                    await ev.wait()
        if self.outstanding and not self.is_open and self.close_reason is not None:
            raise self.close_reason
        ok = not self.nacked
        self.nacked = []
        return ok

    # --- consuming -------------------------------------------------------------------------
    async def basic_consume(self, queue: str, on_message_callback=None, auto_ack: bool = False,
                            exclusive: bool = False, consumer_tag: str | None = None,
                            arguments: dict | None = None) -> Consumer:
        args = dict(arguments or {})
        tag = await self._rpc(lambda rid: m.BasicConsume(rid, self.ch, queue, consumer_tag or "",
                                                         auto_ack, exclusive, args))
        c = Consumer(self, queue, tag, auto_ack, exclusive, args, on_message_callback)
        self.consumers[tag] = c
        for early in self._early.pop(tag, []):
            self._on_deliver(early)
        return c

    async def basic_cancel(self, consumer_tag: str) -> None:
        c = self.consumers.pop(consumer_tag, None)
        await self._rpc(lambda rid: m.BasicCancel(rid, self.ch, consumer_tag))
        if c is not None:
            c._cancelled("cancelled by the application")

    async def basic_get(self, queue: str, auto_ack: bool = False) -> Message | None:
        value = await self._rpc(lambda rid: m.BasicGet(rid, self.ch, queue, auto_ack))
        if value is None:
            return None
        tag, body, redelivered, props, _remaining, *route = value
        self.max_tag = max(self.max_tag, tag)
        exchange, key = route[0] if route else ("", queue)
        return Message(tag + self.tag_offset, body, redelivered, props, "", queue, exchange, key)

    def _server_tags(self, tags, upto: int):
        off = self.tag_offset
        return [t - off for t in tags if t > off], (upto - off if upto > off else 0)

    def basic_ack(self, delivery_tag: int = 0, multiple: bool = False) -> None:
        self._check()
        tag = delivery_tag - self.tag_offset
        if tag <= 0:  # a tag from before a reconnect means nothing to the server now
            return
        if multiple:
            self.conn._put(m.Ack(self.ch, [], tag))
        else:
            self.conn._writer.put_ack(self.ch, tag)

    def basic_nack(self, delivery_tag: int = 0, multiple: bool = False, requeue: bool = True) -> None:
        self._check()
        tags, upto = self._server_tags([] if multiple else [delivery_tag], delivery_tag if multiple else 0)
        if tags or upto:
            self.conn._put(m.Nack(self.ch, tags, upto, requeue))

    def basic_reject(self, delivery_tag: int, requeue: bool = True) -> None:
        self.basic_nack(delivery_tag, False, requeue)

    def _on_deliver(self, msg: m.Deliver) -> None:
        c = self.consumers.get(msg.consumer_tag)
        if c is None:
            # deliveries can arrive in the same read as the consume-ok: keep them for basic_consume
            self._early.setdefault(msg.consumer_tag, []).append(msg)
            return
        first = msg.first_tag
        n = len(msg.bodies)
        self.max_tag = max(self.max_tag, first + n - 1)
        off = self.tag_offset
        red = set(msg.redelivered) if msg.redelivered else ()
        props = msg.props
        tag, queue = c.tag, c.queue
        routes = msg.routes
        if routes is None:
            c._deliver([Message(first + i + off, body, i in red, props[i] if props else None, tag, queue,
                                "", queue)
                        for i, body in enumerate(msg.bodies)])
        else:
            c._deliver([Message(first + i + off, body, i in red, props[i] if props else None, tag, queue,
                                *(routes[i] or ("", queue)))
                        for i, body in enumerate(msg.bodies)])

    async def close(self) -> None:
        if self.is_open:
            self.is_open = False
            try:
                await self.conn._rpc(lambda rid: m.ChannelClose(rid, self.ch), None)
            except (AMQPConnectionError, ChannelClosedByBroker):
                pass
            self.conn.channels.pop(self.ch, None)
            for c in self.consumers.values():
                c._cancelled("channel closed")


def _why(exc) -> str:
    """A connection error in a few words: trio's "all attempts to connect to H:P failed" hides the
    reason (e.g. Connection refused) in its cause."""
    cause = getattr(exc, "__cause__", None)
    while isinstance(cause, BaseExceptionGroup) and cause.exceptions:
        cause = cause.exceptions[0]
    if isinstance(exc, OSError) and isinstance(cause, OSError) and (cause.errno or cause.strerror):
        return os.strerror(cause.errno) if cause.errno else cause.strerror
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    if isinstance(exc, trio.BrokenResourceError) and not str(exc) and cause is not None:
        return f"TLS: {cause}"  # a refused TLS handshake: the node's alert, in the ssl error
    return str(exc) or type(exc).__name__


class Connection:
    def __init__(self, nodes, user: str, password: str, client_name: str, network,
                 reconnect: bool, on_reconnect, max_retry_delay: float, connect_attempts: int,
                 on_blocked=None, on_unblocked=None, ssl_context=None, vhost: str = "/"):
        self.nodes = parse_nodes(nodes)
        if not self.nodes:
            raise ValueError("give at least one node address")
        if ssl_context is not None and network is not None:
            raise ValueError("give ssl_context or network, not both")
        self.user = user
        self.password = password
        self.client_name = client_name
        self.vhost = vhost
        self.network = network or TcpNetwork(dial_tls=ssl_context)
        self.reconnect = reconnect
        self.on_reconnect = on_reconnect
        self.on_disconnect = None
        self.max_retry_delay = max_retry_delay
        self.connect_attempts = connect_attempts
        self.channels: dict[int, Channel] = {}
        self._ch_ids = itertools.count(1)
        self._rids = itertools.count(1)
        self._pending: dict[int, tuple[trio.Event, list, Channel | None]] = {}
        self._writer = _Writer()
        self._stream = None
        self.node: str | None = None
        self.address: tuple | None = None
        self.connected = trio.Event()
        self.closing = False
        self.reconnects = 0
        self._node_index = 0
        self.events: list[tuple[float, str, str]] = []  # (time, event, detail) for the application
        # the node holds this connection (a memory alarm): see the module docstring
        self.blocked = False
        self.blocked_reason = ""
        self.on_blocked = on_blocked
        self.on_unblocked = on_unblocked
        self._unblocked = trio.Event()
        self._unblocked.set()

    # --- public ----------------------------------------------------------------------------
    async def channel(self) -> Channel:
        ch = Channel(self, next(self._ch_ids))
        self.channels[ch.ch] = ch
        await self._rpc(lambda rid: m.ChannelOpen(rid, ch.ch), None)
        return ch

    async def wait_unblocked(self) -> None:
        """Return once the node no longer holds this connection (at once if it does not)."""
        await self._unblocked.wait()

    def _set_blocked(self, blocked: bool, reason: str) -> None:
        if blocked == self.blocked:
            return
        self.blocked = blocked
        self.blocked_reason = reason if blocked else ""
        self.events.append((trio.current_time(), "blocked" if blocked else "unblocked", reason))
        if blocked:
            self._unblocked = trio.Event()
            if self.on_blocked is not None:
                self.on_blocked(reason)
        else:
            self._unblocked.set()
            if self.on_unblocked is not None:
                self.on_unblocked()

    async def close(self) -> None:
        if self.closing:
            return
        self.closing = True
        if self._stream is not None and self.connected.is_set():
            # a blocked connection is not read by the node: do not wait long for the close-ok
            with trio.move_on_after(0.5 if self.blocked else 5):
                try:
                    await self._rpc(lambda rid: m.ConnectionClose(rid), None)
                except AMQPConnectionError:
                    pass
        self._nursery.cancel_scope.cancel()
        self._forget_channels()

    def flush(self) -> None:
        """Send what `publish_nowait` and `basic_ack` queued, now, from the calling task, if the
        connection's writer task is idle (else that task sends it, as it would anyway). For a
        producer about to wait (a paced one before its next send). One that keeps publishing
        should not: the writer task joins its bursts."""
        self._writer.flush()

    @contextmanager
    def corked(self):
        """What is published or acked inside the block is written at its end, from this task, in
        one write (`flush`), and does not wake the writer task meanwhile: for a burst after which
        the task waits anyway (a paced producer's messages that are due), it saves that task's
        wake-up, a pass of trio's scheduler per burst. Nothing inside may wait on the
        connection's writer but `basic_publish`, which sends what is held before it waits for
        room. Inside the reader's handlers (a consumer's callbacks) output is held already."""
        w = self._writer
        if w.holding:
            yield
            return
        w.holding = True
        try:
            yield
        finally:
            w.holding = False
            w.flush()

    # --- plumbing --------------------------------------------------------------------------
    def _put(self, msg) -> None:
        self._writer.put(msg)

    async def _room(self) -> None:
        w = self._writer
        while not w.room.is_set():
            w.flush()  # what a corked block holds must be on its way before anyone waits for room
            await w.room.wait()

    async def _rpc(self, make, channel: Channel | None):
        while not self.connected.is_set():
            if self.closing:
                raise AMQPConnectionError("connection closed")
            await self.connected.wait()
        rid = next(self._rids)
        ev = trio.Event()
        box: list = []
        self._pending[rid] = (ev, box, channel)
        self._put(make(rid))
        await ev.wait()
        kind, value = box[0]
        if kind == "ok":
            return value
        raise value

    def _resolve(self, rid: int, kind: str, value) -> None:
        entry = self._pending.pop(rid, None)
        if entry is not None:
            entry[1].append((kind, value))
            entry[0].set()

    async def _open(self, host: str, port: int):
        stream = await self.network.connect(host, port)
        framed = FramedStream(stream, DEFAULT_MAX_FRAME)
        try:
            with trio.fail_after(10):
                hello = await framed.receive(frozenset({"hello", "error"}))
                if hello is None:
                    raise AMQPConnectionError(f"{host}:{port} closed the connection")
                if isinstance(hello, m.Error):
                    raise ConnectionClosedByBroker(hello.code, hello.text)
                framed.decoder.max_frame = framed.max_frame = hello.max_frame
                await framed.send_now(m.ClientAuth(m.PROTOCOL_VERSION, self.user, self.password,
                                                   self.client_name, self.vhost))
                welcome = await framed.receive(frozenset({"welcome", "error"}))
                if welcome is None:
                    raise AMQPConnectionError(f"{host}:{port} closed the connection during the handshake")
                if isinstance(welcome, m.Error):
                    raise ConnectionClosedByBroker(welcome.code, welcome.text)
        except BaseException:
            await stream.aclose()
            raise
        return framed, welcome.node

    async def _connect_any(self, first: bool) -> None:
        backoff = Backoff(0.05, self.max_retry_delay)  # between rounds of every node
        attempts = 0
        last_error = None
        while True:
            for _ in range(len(self.nodes)):
                host, port = self.nodes[self._node_index % len(self.nodes)]
                try:
                    framed, node = await self._open(host, port)
                except ConnectionClosedByBroker as exc:
                    if exc.reply_code in (403, 530):
                        raise  # wrong credentials, or a vhost the cluster lacks: no node differs
                    last_error = exc
                except (OSError, AMQPConnectionError, trio.TooSlowError, ProtocolError,
                        trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    last_error = exc
                else:
                    self._framed = framed
                    self._stream = framed.stream
                    self._loss = None
                    self.node = node
                    self.address = (host, port)
                    return
                self._node_index += 1
            attempts += 1
            if first and attempts >= self.connect_attempts:
                nodes = ", ".join(f"{h}:{p}" for h, p in self.nodes)
                raise AMQPConnectionError(f"could not connect to {'any of ' if len(self.nodes) > 1 else ''}"
                                          f"{nodes}: {_why(last_error)}")
            await backoff.wait()

    async def _serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        first = True
        while True:
            await self._connect_any(first)
            try:
                async with trio.open_nursery() as n:
                    n.start_soon(self._write_loop, n.cancel_scope)
                    n.start_soon(self._read_loop, n.cancel_scope)
                    self.connected.set()
                    if first:
                        task_status.started()
                    else:
                        await self._recover()
                    first = False
            except AMQPConnectionError as exc:  # a failed recovery request
                error = exc
            else:
                error = self._loss
            finally:  # cancelled too (the caller gave up on the connection): the socket closes
                with trio.CancelScope(shield=True):
                    await self._stream.aclose()
            self.connected = trio.Event()
            if self.closing:
                for rid in list(self._pending):
                    self._resolve(rid, "err", ConnectionLost("connection closed"))
                return  # (close() lets go of the channels)
            self._lost(error)
            if not self.reconnect:
                self._forget_channels()
                raise error if isinstance(error, AMQPConnectionError) else ConnectionLost(str(error))

    def _forget_channels(self) -> None:
        """The connection is over: it lets go of its channels, and they of their consumers.
        Each refers back to its owner, so without this a closed connection waited for the
        interpreter's rare full collection (the node's management API opens one per request)."""
        for ch in self.channels.values():
            ch.consumers.clear()
        self.channels.clear()

    def _lost(self, error) -> None:
        """The connection went away: fail requests, report unconfirmed publishes, keep tags monotonic."""
        self._writer.drop()
        err = error if isinstance(error, AMQPConnectionError) else ConnectionLost(f"connection lost: {error}")
        for rid in list(self._pending):
            self._resolve(rid, "err", err)
        for ch in self.channels.values():
            lost = sorted(ch.outstanding)
            ch.outstanding.clear()
            for s in lost:
                ch.nacked.append((s, s, "connection lost"))
                if ch.on_confirm is not None:
                    ch.on_confirm(s, s, False, "connection lost")
            for ev in ch._confirm_waiters:
                ev.set()
            ch._confirm_waiters.clear()
            ch.tag_offset += ch.max_tag
            ch.max_tag = 0
            ch._held = []  # until _recover has the channel back
        self.events.append((trio.current_time(), "disconnected", str(error)))
        self._set_blocked(False, "connection lost")  # the next node says if it holds us
        if self.on_disconnect is not None:
            self.on_disconnect(error)
        self._node_index += 1

    async def _recover(self) -> None:
        """Re-open channels, re-declare queues, re-create consumers on the new connection."""
        self.reconnects += 1
        for ch in list(self.channels.values()):
            if not ch.is_open:
                continue
            await self._rpc(lambda rid: m.ChannelOpen(rid, ch.ch), None)
            if ch.prefetch:
                await self._rpc(lambda rid: m.BasicQos(rid, ch.ch, ch.prefetch, False), ch)
            if ch.confirming:
                await self._rpc(lambda rid: m.ConfirmSelect(rid, ch.ch), ch)
            held, ch._held = ch._held or [], None
            if ch.confirming:
                # the server numbers this connection's publishes from 1: the first held one
                first = next((seq for seq, _ in held if seq is not None), ch.next_seq)
                ch._seq_base = first - 1
            for _, msg in held:
                self._put(msg)
            for x, (kind, durable, auto_delete, internal, args) in ch.exchanges.items():
                await self._recover_step(ch, lambda rid: m.ExchangeDeclare(
                    rid, ch.ch, x, kind, False, durable, auto_delete, internal, args))
            for q, d in list(ch.declared.items()):
                # a server-named queue is named by the server again (an amq.gen- name may not
                # be asked for): its bindings and consumers follow it to its new name
                asked = "" if d["server_named"] else q
                ok = await self._recover_step(ch, lambda rid: m.QueueDeclare(
                    rid, ch.ch, asked, False, d["durable"], d["exclusive"], d["auto_delete"], d["arguments"]))
                if ok is not REFUSED and ok[0] != q:
                    ch._renamed(q, ok[0])
                    self.events.append((trio.current_time(), "queue-renamed", f"{q} -> {ok[0]}"))
            for kind, dest, source, key, args in ch.bindings:
                bind = m.QueueBind if kind == "queue" else m.ExchangeBind
                await self._recover_step(ch, lambda rid: bind(rid, ch.ch, dest, source, key, args))
            for tag, c in list(ch.consumers.items()):
                if await self._recover_step(ch, lambda rid: m.BasicConsume(
                        rid, ch.ch, c.queue, tag, c.auto_ack, c.exclusive, c.arguments)) is REFUSED:
                    ch.consumers.pop(tag, None)
                    c._cancelled("could not re-create the consumer after reconnecting")
        self.events.append((trio.current_time(), "reconnected", self.node))
        if self.on_reconnect is not None:
            self.on_reconnect(self.node)

    async def _recover_step(self, ch: Channel, make):
        """One request of a channel's recovery: its answer, or REFUSED (the broker then closed
        the channel, so the channel's later steps are not sent)."""
        if not ch.is_open:
            return REFUSED
        try:
            return await self._rpc(make, ch)
        except ChannelClosedByBroker as exc:
            self.events.append((trio.current_time(), "recovery-failed", str(exc)))
            return REFUSED

    async def _write_loop(self, scope) -> None:
        w = self._writer
        stream = self._stream
        direct = w.direct
        direct.sock, w.max_frame = direct_socket(stream), self._framed.max_frame
        try:
            while True:
                if not w.items and not direct.rest:
                    await w.wake.wait()
                w.wake = trio.Event()  # what is put from here on wakes the next turn
                # a direct write's tail first, then what the application put meanwhile: one write
                await direct.send(stream, w.take_parts)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self._loss = ConnectionLost(f"connection to {self.node} broke: {exc!r}")
            scope.cancel()
        finally:
            direct.sock = None  # no direct writes to a connection that is going away

    async def _read_loop(self, scope) -> None:
        framed = self._framed
        w = self._writer
        framed.reader.on_wait = w.flush
        while True:
            try:
                batch = await framed.receive_batch()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                self._loss = ConnectionLost(f"connection to {self.node} broke: {exc!r}")
                scope.cancel()
                return
            except ProtocolError as exc:
                self._loss = ConnectionLost(f"protocol error from the node: {exc}")
                scope.cancel()
                return
            if not batch:
                self._loss = ConnectionLost(f"node {self.node} closed the connection")
                scope.cancel()
                return
            # what the handlers queue (a consumer's acks) is held, not handed to the writer task:
            # the reader sends it itself when it is about to wait (`on_wait`, set above), so the
            # acks of several reads in a row still leave together, without that task's wake-up
            w.holding = True
            try:
                if not self._handle_batch(batch):
                    scope.cancel()
                    return
            finally:
                w.holding = False

    def _handle_batch(self, batch: list) -> bool:
        """Act on one read's messages; False when the node closed the connection (Error)."""
        channels = self.channels
        for msg in batch:
            t = type(msg)
            if t is m.Deliver:
                ch = channels.get(msg.ch)
                if ch is not None:
                    ch._on_deliver(msg)
            elif t is m.Confirm:
                ch = channels.get(msg.ch)
                if ch is not None:
                    for a, b in msg.acks:
                        ch._confirm(a, b, True, "")
                    for a, b in msg.nacks:
                        ch._confirm(a, b, False, msg.reason)
            elif t is m.Reply:
                self._resolve(msg.rid, "ok", msg.value)
            elif t is m.Fail:
                err = ChannelClosedByBroker(msg.code, msg.text)
                ch = channels.get(msg.ch)
                if ch is not None:
                    ch.is_open = False
                    ch.close_reason = err
                    channels.pop(msg.ch, None)
                    for c in ch.consumers.values():
                        c._cancelled(f"channel closed: {msg.text}")
                    for ev in ch._confirm_waiters:  # what they wait for will not come
                        ev.set()
                    ch._confirm_waiters.clear()
                    # requests sent on it before the news came are not answered (the node reads
                    # nothing on a channel it closed): they fail with it
                    for rid in [r for r, entry in self._pending.items() if entry[2] is ch]:
                        self._resolve(rid, "err", err)
                self._resolve(msg.rid, "err", err)
            elif t is m.Returned:
                ch = channels.get(msg.ch)
                if ch is not None:
                    ch._on_returned(msg)
            elif t is m.Cancelled:
                ch = channels.get(msg.ch)
                if ch is not None:
                    c = ch.consumers.pop(msg.consumer_tag, None)
                    if c is not None:
                        c._cancelled(msg.reason)
            elif t is m.Blocked:
                self._set_blocked(True, msg.reason)
            elif t is m.Unblocked:
                self._set_blocked(False, "")
            elif t is m.Error:
                self._loss = ConnectionClosedByBroker(msg.code, msg.text)
                return False
        return True


@asynccontextmanager
async def open_connection(nodes="127.0.0.1:5672", *, user: str = "guest", password: str = "guest",
                          client_name: str = "warren-client", network=None, reconnect: bool = True,
                          on_reconnect=None, max_retry_delay: float = 2.0, connect_attempts: int = 1,
                          on_blocked=None, on_unblocked=None, ssl_context=None, vhost: str = "/"):
    """Connect to the first reachable node of `nodes` ("host:port" strings or (host, port)),
    into virtual host `vhost` (an unknown one is refused: AMQPError 530).
    `ssl_context` (an `ssl.SSLContext` for the client side, e.g. `broker.tls.client_context(cert,
    key, ca)`): connect over TLS, to nodes whose client port speaks it.
    `on_blocked(reason)` / `on_unblocked()`: the node holds this connection (memory alarm) / no
    longer does."""
    conn = Connection(nodes, user, password, client_name, network, reconnect, on_reconnect,
                      max_retry_delay, connect_attempts, on_blocked, on_unblocked, ssl_context, vhost)
    try:
        async with trio.open_nursery() as nursery:
            conn._nursery = nursery
            await nursery.start(conn._serve)
            try:
                yield conn
            finally:
                await conn.close()
    except BaseExceptionGroup as eg:
        # surface the connection error itself rather than a group of one
        if len(eg.exceptions) == 1:
            raise eg.exceptions[0] from None
        raise

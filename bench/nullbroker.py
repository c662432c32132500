"""A null AMQP 0-9-1 broker: the cheapest server the load generator can talk to.

`python -m bench.nullbroker --ports 5801,5802,5803` listens on each port (the "nodes" of the
`null` target; one asyncio process, one set of queues). It does what the generator needs and
nothing more: the handshake (PLAIN, any user), channels, `confirm.select`, `basic.qos`,
`queue.declare`/`delete`, `basic.publish` (stored in an in-memory deque per queue and confirmed
at once, one `multiple` ack per read), `basic.consume` (delivered within the prefetch),
`basic.ack`. No exchanges beyond the default one, no persistence, no mirroring, no checks.

What it is for: the `gencheck` suite runs the generator against it, so the figures it gives are
what the generator can do when the broker costs next to nothing. When those are far above what
a real broker reaches in the same suite, the generator was not the limit (bench/README.md).
The tests also use it to exercise the AMQP generator where no RabbitMQ is installed.

The floor (`--mirrors PORT,PORT`, the `floor` target): what a mirrored confirm costs a broker
of separate Python processes on trio, and nothing else. Each mirror is a process of its own
(`python -m bench.nullbroker --mirror --ports PORT`) that reads length-prefixed records and
answers each read that held publishes with the count of publishes it has had so far (8 bytes).
The broker sends every stored body to every mirror (one write per mirror per read of a client),
and confirms a publish only when every mirror has counted it, so a confirm crosses the hops a
mirrored one does (producer, leader, mirrors, leader, producer) and nothing else: no queue state
on the mirrors, no metadata, no checks. A consumer's acks ride to the mirrors with the next
publish, as warren's do. Deliveries leave at once from the leader's process (the consumer
connects to it: one hop fewer than on a real cluster, where it is on another node). The floor's
processes run on trio, reading each socket with warren's own `Reader` (broker/framed.py: a
non-blocking read, and `trio.lowlevel.wait_readable` when there is nothing to read) and writing
with the nodes' own `write_now` and `send_parts`, so each wake-up is a pass of trio's run loop as
in a warren node. A broker written that way cannot confirm faster than the floor does on the
same machine: where warren's figures sit between the floor and RabbitMQ's says how much is
warren's own code and how much the price of Python and trio.

Frames are split on their headers; methods are decoded by pamqp, except `basic.publish` and
`basic.ack` on the hot path, read with `struct` (checked against pamqp in the tests); deliveries
are pamqp-marshalled templates with the delivery tag put in.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import struct
from collections import deque

from pamqp import commands as C
from pamqp import frame as pframe
from pamqp import header as pheader

import trio

from broker.framed import Reader, send_parts, write_now

_HEAD = struct.Struct(">BHI")
_REC = struct.Struct(">I")  # a record's length, to a mirror
_COUNT = struct.Struct(">Q")  # a mirror's answer: publishes counted so far
ACKS_HELD = 1024  # a consumer's acks waiting for a publish to ride to the mirrors with
_INDEX = struct.Struct(">I")
_U64_BITS = struct.Struct(">QB")
PUBLISH = C.Basic.Publish.index
ACK = C.Basic.Ack.index
PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"


class Queue:
    def __init__(self, name: str):
        self.name = name
        self.messages: deque = deque()
        self.consumers: deque = deque()   # of _Consumer, served round-robin

    def pump(self) -> None:
        msgs, cons = self.messages, self.consumers
        while msgs and cons:
            for _ in range(len(cons)):
                c = cons[0]
                cons.rotate(-1)
                if c.ch.closed:
                    cons.remove(c)
                    break
                if c.prefetch == 0 or c.ch.unacked < c.prefetch:
                    c.deliver(msgs.popleft())
                    break
            else:
                return  # every consumer is at its prefetch


class Broker:
    def __init__(self):
        self.queues: dict[str, Queue] = {}
        self.dirty: set[Queue] = set()
        self.mirrors: list[_MirrorLink] = []  # none: confirm at once
        self.sent = 0  # publishes sent to the mirrors
        self.waiting: deque = deque()  # (publishes sent, channel, its publish count) to confirm
        self.closing = False

    def mirror(self, body: bytes) -> None:
        """Send a stored body to every mirror (written at the end of the read)."""
        self.sent += 1
        rec = _REC.pack(len(body) + 1) + b"P" + body
        for m in self.mirrors:
            m.out.append(rec)
            m.publishes = True

    def mirror_ack(self, tag: int, multiple: bool) -> None:
        """A consumer's ack, for the mirrors: it waits for the next publish's write (or goes
        with others once ACKS_HELD are waiting, so a consumer alone cannot pile them up)."""
        rec = _REC.pack(10) + b"A" + _U64_BITS.pack(tag, multiple)
        for m in self.mirrors:
            m.out.append(rec)
            if len(m.out) >= ACKS_HELD:
                m.publishes = True

    def confirm_counted(self) -> None:
        """Confirm what every mirror has counted."""
        low = min(m.counted for m in self.mirrors)
        waiting = self.waiting
        while waiting and waiting[0][0] <= low:
            _, ch, upto = waiting.popleft()
            if upto > ch.confirmed and not ch.closed:
                ch.confirmed = upto
                ch.conn.send(C.Basic.Ack(delivery_tag=upto, multiple=True), ch.number)

    def queue(self, name: str) -> Queue:
        q = self.queues.get(name)
        if q is None:
            q = self.queues[name] = Queue(name)
        return q

    def pump(self) -> None:
        dirty, self.dirty = self.dirty, set()
        for q in dirty:
            q.pump()


class _Consumer:
    def __init__(self, ch: "_Channel", queue: Queue, tag: str, no_ack: bool):
        self.ch, self.queue, self.tag, self.no_ack = ch, queue, tag, no_ack
        self.prefetch = 0 if no_ack else ch.prefetch
        deliver = pframe.marshal(C.Basic.Deliver(consumer_tag=tag, delivery_tag=0, redelivered=False,
                                                 exchange="", routing_key=queue.name), ch.number)
        # the tag sits after the 7-byte frame header, the 4-byte index and the consumer tag
        at = 7 + 4 + 1 + len(tag.encode())
        self.before, self.after = deliver[:at], deliver[at + 8:]
        self.headers: dict[int, bytes] = {}

    def deliver(self, body: bytes) -> None:
        ch = self.ch
        ch.tag += 1
        if not self.no_ack:
            ch.unacked += 1
        hdr = self.headers.get(len(body))
        if hdr is None:
            hdr = self.headers[len(body)] = pframe.marshal(
                pheader.ContentHeader(0, len(body), C.Basic.Properties()), ch.number)
        _PENDING.add(ch.conn)
        ch.conn.out.append(self.before + ch.tag.to_bytes(8, "big") + self.after + hdr
                           + _HEAD.pack(3, ch.number, len(body)) + body + b"\xce")


class _Channel:
    def __init__(self, conn: "_Connection", number: int):
        self.conn, self.number = conn, number
        self.confirming = False
        self.published = 0
        self.confirmed = 0
        self.noted = 0  # publishes waiting on the mirrors for their confirm (mirrored only)
        self.prefetch = 0
        self.tag = 0
        self.unacked = 0
        self.closed = False
        self.consumers: list[_Consumer] = []
        self.pending_queue: Queue | None = None
        self.pending_size = 0
        self.pending_parts: list = []


class _Connection(asyncio.Protocol):
    def __init__(self, broker: Broker):
        self.broker = broker
        self.transport = None
        self.buf = b""
        self.started = False
        self.channels: dict[int, _Channel] = {}
        self.out: list = []

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        for ch in self.channels.values():
            ch.closed = True

    def send(self, method, channel: int) -> None:
        _PENDING.add(self)
        self.out.append(pframe.marshal(method, channel))

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        off, n = 0, len(buf)
        if not self.started:
            if n < 8:
                self.buf = buf
                return
            if buf[:8] != PROTOCOL_HEADER:
                self.transport.write(PROTOCOL_HEADER)
                self.transport.close()
                return
            self.started = True
            off = 8
            self.send(C.Connection.Start(server_properties={"product": "warren-bench null broker",
                                                            "capabilities": {"publisher_confirms": True,
                                                                             "basic.nack": True}},
                                         mechanisms="PLAIN AMQPLAIN", locales="en_US"), 0)
        broker = self.broker
        while n - off >= 8:
            ftype, chn, size = _HEAD.unpack_from(buf, off)
            end = off + 7 + size
            if end >= n:
                break
            start = off + 7
            off = end + 1
            ch = self.channels.get(chn)
            if ftype == 3:
                if ch is not None and ch.pending_queue is not None:
                    ch.pending_parts.append(buf[start:end])
                    ch.pending_size -= end - start
                    if ch.pending_size <= 0:
                        self._stored(ch)
            elif ftype == 1:
                index = _INDEX.unpack_from(buf, start)[0]
                if index == PUBLISH and ch is not None:
                    p = start + 4 + 2                 # ticket
                    p += 1 + buf[p]                   # exchange
                    rk = bytes(buf[p + 1:p + 1 + buf[p]]).decode()
                    ch.pending_queue = broker.queue(rk)
                    ch.pending_parts = []
                elif index == ACK and ch is not None:
                    tag, bits = _U64_BITS.unpack_from(buf, start + 4)
                    if bits & 1:
                        ch.unacked = max(0, ch.unacked - (tag - (ch.tag - ch.unacked)))
                    else:
                        ch.unacked = max(0, ch.unacked - 1)
                    if broker.mirrors:
                        broker.mirror_ack(tag, bool(bits & 1))
                    for c in ch.consumers:
                        broker.dirty.add(c.queue)
                else:
                    self._method(chn, ch, pframe.unmarshal(bytes(buf[off - size - 8:off]))[2])
            elif ftype == 2 and ch is not None and ch.pending_queue is not None:
                ch.pending_size = struct.unpack_from(">Q", buf, start + 4)[0]
                if ch.pending_size == 0:
                    self._stored(ch)
        self.buf = buf[off:] if off < n else b""
        for c in self.channels.values():
            if c.confirming and c.confirmed < c.published:
                if broker.mirrors:
                    if c.noted < c.published:
                        c.noted = c.published
                        broker.waiting.append((broker.sent, c, c.published))
                else:
                    c.confirmed = c.published
                    self.send(C.Basic.Ack(delivery_tag=c.published, multiple=True), c.number)
        broker.pump()
        for m in broker.mirrors:
            m.flush()
        _flush_all()

    def _stored(self, ch: _Channel) -> None:
        q = ch.pending_queue
        q.messages.append(b"".join(ch.pending_parts) if len(ch.pending_parts) != 1 else bytes(ch.pending_parts[0]))
        ch.pending_queue = None
        ch.pending_parts = []
        ch.published += 1
        if self.broker.mirrors:
            self.broker.mirror(q.messages[-1])
        if q.consumers:
            self.broker.dirty.add(q)

    def _method(self, chn: int, ch: _Channel | None, m) -> None:
        if isinstance(m, C.Connection.StartOk):
            self.send(C.Connection.Tune(channel_max=2047, frame_max=131072, heartbeat=0), 0)
        elif isinstance(m, C.Connection.Open):
            self.send(C.Connection.OpenOk(), 0)
        elif isinstance(m, C.Connection.Close):
            self.send(C.Connection.CloseOk(), 0)
            self._flush()
            self.transport.close()
        elif isinstance(m, C.Channel.Open):
            self.channels[chn] = _Channel(self, chn)
            self.send(C.Channel.OpenOk(), chn)
        elif isinstance(m, C.Channel.Close):
            if ch is not None:
                ch.closed = True
                self.channels.pop(chn, None)
            self.send(C.Channel.CloseOk(), chn)
        elif ch is None:
            return
        elif isinstance(m, C.Confirm.Select):
            ch.confirming = True
            self.send(C.Confirm.SelectOk(), chn)
        elif isinstance(m, C.Basic.Qos):
            ch.prefetch = m.prefetch_count
            self.send(C.Basic.QosOk(), chn)
        elif isinstance(m, C.Queue.Declare):
            q = self.broker.queue(m.queue)
            self.send(C.Queue.DeclareOk(queue=m.queue, message_count=len(q.messages),
                                        consumer_count=len(q.consumers)), chn)
        elif isinstance(m, C.Queue.Delete):
            q = self.broker.queues.pop(m.queue, None)
            self.send(C.Queue.DeleteOk(message_count=len(q.messages) if q else 0), chn)
        elif isinstance(m, C.Basic.Consume):
            q = self.broker.queue(m.queue)
            tag = m.consumer_tag or f"null-{id(self):x}-{chn}-{len(ch.consumers)}"
            self.send(C.Basic.ConsumeOk(consumer_tag=tag), chn)
            c = _Consumer(ch, q, tag, m.no_ack)
            ch.consumers.append(c)
            q.consumers.append(c)
            self.broker.dirty.add(q)

    def _flush(self) -> None:
        if self.out:
            self.transport.write(b"".join(self.out))
            self.out = []


_PENDING: set = set()  # connections with something to send


def _flush_all() -> None:
    while _PENDING:
        c = _PENDING.pop()
        if c.out and not c.transport.is_closing():
            c._flush()
        c.out = []


class _MirrorLink:
    """The broker's connection to one mirror: records out, counts back."""

    def __init__(self, broker: Broker):
        self.broker = broker
        self.transport = None
        self.out: list = []
        self.publishes = False  # `out` holds a publish: write it (acks alone wait)
        self.counted = 0
        self.buf = b""

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        if not self.broker.closing:
            print(f"null broker: a mirror went away ({exc or 'closed'})", flush=True)
            os._exit(1)

    def flush(self) -> None:
        """Write what is queued for the mirror, if it holds a publish (or too many acks)."""
        if self.publishes:
            self.publishes = False
            self.transport.write(b"".join(self.out))
            self.out = []

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data
        whole = len(buf) - len(buf) % 8
        if whole:
            self.counted = _COUNT.unpack_from(buf, whole - 8)[0]
            self.broker.confirm_counted()
            _flush_all()
        self.buf = buf[whole:]


class _Mirror:
    """A mirror process's end: count the publishes of each read, answer with the total."""

    def __init__(self):
        self.transport = None
        self.buf = b""
        self.count = 0

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        pass  # the broker went away: nothing to count any more

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        off, n, got = 0, len(buf), 0
        while n - off >= 4:
            size = _REC.unpack_from(buf, off)[0]
            if n - off - 4 < size:
                break
            if buf[off + 4] == 0x50:  # b"P"
                got += 1
            off += 4 + size
        self.buf = buf[off:]
        if got:
            self.count += got
            self.transport.write(_COUNT.pack(self.count))


async def serve(host: str, ports: list[int]) -> None:
    """The null broker (no mirrors) on asyncio, until SIGTERM or SIGINT."""
    broker = Broker()
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(lambda: _Connection(broker), host, port, backlog=1024)
               for port in ports]
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"null broker {os.getpid()} on {', '.join(f'{host}:{p}' for p in ports)}", flush=True)
    await stop.wait()
    broker.closing = True
    for s in servers:
        s.close()


# --- the floor: the same classes on trio, mirrored ---------------------------------------------

class _TrioTransport:
    """What the protocol classes above use of an asyncio transport (`write`, `close`,
    `is_closing`), over a non-blocking socket in trio, written as warren's nodes write
    (broker/framed.py): what the socket takes now goes at once (`write_now`); the rest, and what
    is written meanwhile, goes in order from a drain task (`send_parts`)."""

    def __init__(self, sock: socket.socket, nursery):
        self.sock = sock
        self.nursery = nursery
        self.pending: list = []  # what waits for the drain task, in order
        self.draining = False  # the drain task runs: every write queues behind it
        self.closing = False

    def write(self, data: bytes) -> None:
        if self.closing:
            return
        if self.draining:
            self.pending.append(data)
            return
        self.pending = write_now(self.sock, [data])
        if self.pending:
            self.draining = True
            self.nursery.start_soon(self._drain)

    async def _drain(self) -> None:
        try:
            while self.pending and not self.closing:
                parts, self.pending = self.pending, []
                await send_parts(None, self.sock, parts)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.closing = True
            self.pending = []
        finally:
            self.draining = False

    def close(self) -> None:
        if not self.closing or self.sock.fileno() != -1:
            self.closing = True
            trio.lowlevel.notify_closing(self.sock)
            self.sock.close()

    def is_closing(self) -> bool:
        return self.closing


async def _trio_read(sock: socket.socket, proto) -> None:
    """Feed `proto` what `sock` brings until it closes, read by warren's own `Reader`
    (broker/framed.py), as the nodes read their sockets."""
    reader = Reader(trio.SocketStream(trio.socket.from_stdlib_socket(sock)))
    try:
        while True:
            try:
                data = await reader.receive_some(256 * 1024)
            except (trio.ClosedResourceError, trio.BrokenResourceError):  # (closed by our side)
                data = b""
            if not data:
                proto.connection_lost(None)
                return
            proto.data_received(data)
    finally:
        if sock.fileno() != -1:
            sock.close()


def _trio_socket(sock: socket.socket) -> socket.socket:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


async def _trio_accept(nursery, lsock: socket.socket, make) -> None:
    while True:
        await trio.lowlevel.wait_readable(lsock)
        try:
            sock, _ = lsock.accept()
        except BlockingIOError:
            continue
        proto = make()
        proto.connection_made(_TrioTransport(_trio_socket(sock), nursery))
        nursery.start_soon(_trio_read, sock, proto)


def _listen(host: str, port: int) -> socket.socket:
    lsock = socket.socket()
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind((host, port))
    lsock.listen(1024)
    lsock.setblocking(False)
    return lsock


async def serve_trio(host: str, ports: list[int], mirrors: list[int] = (), mirror: bool = False) -> None:
    """The broker mirrored to the null mirrors on `mirrors` (or, with `mirror`, a null mirror on
    `ports`) on trio, until SIGTERM or SIGINT."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            broker = Broker()
            for port in mirrors:
                sock = socket.create_connection((host, port))
                link = _MirrorLink(broker)
                link.connection_made(_TrioTransport(_trio_socket(sock), nursery))
                broker.mirrors.append(link)
                nursery.start_soon(_trio_read, sock, link)
            make = _Mirror if mirror else (lambda: _Connection(broker))
            for port in ports:
                nursery.start_soon(_trio_accept, nursery, _listen(host, port), make)
            what = "null mirror" if mirror else "null broker"
            print(f"{what} {os.getpid()} (trio) on {', '.join(f'{host}:{p}' for p in ports)}", flush=True)
            async for _ in signals:
                broker.closing = True
                nursery.cancel_scope.cancel()
                break


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.nullbroker", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--ports", required=True, help="comma-separated ports, one per pretend node")
    ap.add_argument("--mirrors", default="",
                    help="comma-separated ports of null mirrors to mirror every queue to (the floor, on trio)")
    ap.add_argument("--mirror", action="store_true", help="be a null mirror (on trio) on the one port of --ports")
    args = ap.parse_args(argv)
    ports = [int(p) for p in args.ports.split(",")]
    mirrors = [int(p) for p in args.mirrors.split(",") if p]
    if args.mirror and len(ports) != 1:
        ap.error("a mirror listens on one port")
    if args.mirror or mirrors:
        trio.run(serve_trio, args.host, ports, mirrors, args.mirror)
    else:
        asyncio.run(serve(args.host, ports))


if __name__ == "__main__":
    main()

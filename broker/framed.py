"""A trio stream carrying wire frames: batched reads and a batching writer.

`FramedStream.receive_batch()` returns every message decoded from one read, so a burst of small
frames costs one wake-up. `Outbox` is a connection's single writer: senders append messages
without waiting and the writer task encodes everything queued and hands the frames' parts to
one `writev` (`send_parts`: headers and bodies go out as they are, never joined). It sends as
soon as there is something to send; under load, what arrives during a send forms the next batch
(corking without a timer: measured against waiting up to 2 ms for the process to go idle, it
gave lower latency at 2,000 msgs/s and higher mirrored throughput). Senders on a
hot path call `wait_below_watermark()` so a slow reader back-pressures them instead of filling
memory.
"""

from __future__ import annotations

import os

import trio

from wire.errors import UNEXPECTED_FRAME, FrameError, ProtocolError
from wire.frames import DEFAULT_MAX_FRAME, HEADER, FrameDecoder
from wire.schema import decode_bytes, encode

READ_SIZE = 256 * 1024


class Reader:
    """Reads a stream's bytes; for a socket, straight from its descriptor.

    trio's `SocketStream.receive_some` yields to the scheduler after every read that found data
    (a pass of the run loop, with its `epoll_wait`, before the bytes are handled), and the read
    that follows finds the socket empty. On a node that handles each message alone (a steady
    2,000 msgs/s), that pass is paid at every hop. Here a read that finds data returns it at once;
    a read that finds nothing waits for the socket (`wait_readable`, a checkpoint). A read that
    took less than it asked for left the socket empty, so the next one waits first rather than
    fail (each failed read is a system call and an exception, once per wake-up of a node). So
    that a stream that always has data cannot keep the other tasks waiting, every STREAK-th read
    in a row checkpoints first, before it takes any bytes: a cancelled read has taken nothing.

    Other streams (the simulation's) are read with `receive_some`.

    `on_wait`, if set, is called each time the reader is about to yield (it found the socket
    empty, or it is at the end of a streak, or the stream is not a socket): the native client
    sends what its handlers queued there, once the reads in a row are over.
    """

    STREAK = 8

    __slots__ = ("stream", "_sock", "_streak", "_short", "on_wait")

    def __init__(self, stream) -> None:
        self.stream = stream
        self._sock = direct_socket(stream)
        self._streak = 0
        self._short = False
        self.on_wait = None

    async def receive_some(self, max_bytes: int) -> bytes:
        sock = self._sock
        if sock is None:
            if self.on_wait is not None:
                self.on_wait()
            return await self.stream.receive_some(max_bytes)
        if self._streak >= self.STREAK:
            self._streak = 0
            if self.on_wait is not None:
                self.on_wait()
            await trio.lowlevel.checkpoint()
        while True:
            fd = sock.fileno()
            if fd < 0:
                raise trio.ClosedResourceError("the connection was closed")
            if self._short:
                # the last read took less than it asked for, so it left the socket empty: a
                # read now would most likely fail (a system call and an exception); wait first
                self._short = False
            else:
                try:
                    data = os.read(fd, max_bytes)
                except BlockingIOError:
                    pass
                except OSError as exc:
                    raise trio.BrokenResourceError(f"connection broken: {exc}") from exc
                else:
                    self._streak += 1
                    self._short = len(data) < max_bytes
                    return data
            self._streak = 0
            if self.on_wait is not None:
                self.on_wait()
            await trio.lowlevel.wait_readable(sock)


class FramedStream:
    def __init__(self, stream: trio.abc.Stream, max_frame: int = DEFAULT_MAX_FRAME):
        self.stream = stream
        self.reader = Reader(stream)
        self.decoder = FrameDecoder(max_frame, decode_bytes)
        self.max_frame = max_frame
        self._pending: list = []
        self.last_read = 0  # bytes taken by the last receive_batch from the stream (0: none)

    async def receive_batch(self, allowed: frozenset[str] | None = None) -> list:
        """Messages from the next read; [] means a clean end of stream. Raises ProtocolError.
        Messages that `receive` read ahead (they came in the same read) come first."""
        if self._pending:
            self.last_read = 0
            out, self._pending = self._pending, []
            for msg in out:
                if allowed is not None and msg.KIND not in allowed:
                    raise ProtocolError(UNEXPECTED_FRAME, f"message {msg.KIND!r} is not allowed here")
            return out
        while True:
            data = await self.reader.receive_some(READ_SIZE)
            self.last_read = len(data)
            if not data:
                self.decoder.check_eof()
                return []
            msgs = self.decoder.feed(data)
            if msgs:
                if allowed is not None:
                    for msg in msgs:
                        if msg.KIND not in allowed:
                            raise ProtocolError(UNEXPECTED_FRAME, f"message {msg.KIND!r} is not allowed here")
                return msgs

    async def receive(self, allowed: frozenset[str] | None = None):
        """One message, or None at end of stream."""
        if not self._pending:
            # decode the whole read unrestricted: the frames after this one (the peer may send
            # them without waiting, e.g. link.hello right after peer.welcome) are checked when
            # they are taken
            self._pending = await self.receive_batch()
            if not self._pending:
                return None
        msg = self._pending.pop(0)
        if allowed is not None and msg.KIND not in allowed:
            if msg.KIND == "error":
                raise ProtocolError(msg.code, msg.text)
            raise ProtocolError(UNEXPECTED_FRAME, f"message {msg.KIND!r} is not allowed here")
        return msg

    async def send_now(self, *msgs) -> None:
        """Encode and send directly (handshake and error paths, before an Outbox runs)."""
        await self.stream.send_all(encode_many(msgs, self.max_frame))


class Encoded:
    """A message encoded once for several connections (a replication batch for every mirror):
    an Outbox takes it like a message and copies its bytes as they are."""

    __slots__ = ("head", "body")

    def __init__(self, msg, max_frame: int):
        body = encode(msg)
        if len(body) > max_frame:
            raise FrameError(f"outgoing {msg.KIND!r} frame of {len(body)} bytes exceeds the maximum frame size {max_frame}")
        self.head = HEADER.pack(len(body))
        self.body = body


def frame_parts(msgs, max_frame: int) -> list:
    """Messages as the byte strings of their frames, in order (header, body, header, body...):
    written with one `writev`, they reach the wire without first being joined into one copy."""
    parts = []
    append = parts.append
    pack = HEADER.pack
    for m in msgs:
        if type(m) is Encoded:
            append(m.head)
            append(m.body)
            continue
        body = encode(m)
        if len(body) > max_frame:
            raise FrameError(f"outgoing {m.KIND!r} frame of {len(body)} bytes exceeds the maximum frame size {max_frame}")
        append(pack(len(body)))
        append(body)
    return parts


def encode_many(msgs, max_frame: int) -> bytes:
    return b"".join(frame_parts(msgs, max_frame))


class Cork:
    """Holds writers back during one synchronous stretch of work and sends its output at the end.

    A queue's round (broker/queue_process.py) produces, in one go, the replication batch for each
    mirror, deliveries and confirms for sessions. Waking each connection's writer task would cost
    a pass of trio's scheduler before anything is sent, per hop, and a mirrored publish crosses
    several hops. Inside `with CORK:` a writer that is given output is only noted; at the end of
    the stretch each is flushed from the task that produced the output: one non-blocking write
    straight to the socket when its writer task is idle, or else a wake-up of that task (a send
    in flight, a stream that is not a socket such as the simulation's). Nothing awaits inside a
    corked stretch, so output cannot be held while its producer waits.

    One per process: trio runs one task at a time, so a synchronous stretch is the only code
    running while it is corked, whichever node (in the simulation) it belongs to.
    """

    __slots__ = ("depth", "held")

    def __init__(self) -> None:
        self.depth = 0
        self.held: list = []  # writers given output while corked, each once

    def __enter__(self) -> "Cork":
        self.depth += 1
        return self

    def hold(self, writer) -> bool:
        """Note `writer` (it has `_held` and `flush()`) to flush at the stretch's end; False when
        nothing is corked (the caller wakes its writer task instead)."""
        if not self.depth:
            return False
        if not writer._held:
            writer._held = True
            self.held.append(writer)
        return True

    def __exit__(self, *exc) -> None:
        self.depth -= 1
        if self.depth == 0 and self.held:
            held, self.held = self.held, []
            for writer in held:
                writer.flush()


CORK = Cork()


def direct_socket(stream):
    """The socket under a SocketStream, for direct non-blocking reads and writes (None for other
    streams, such as the simulation's: their tasks use the stream's own methods). It is the
    standard library's socket inside trio's (trio's `fileno()` is a Python call in front of it,
    paid at every read and write); trio closes that same object, so `fileno()` turns -1."""
    sock = getattr(stream, "socket", None)
    if not hasattr(sock, "fileno"):
        return None
    inner = getattr(sock, "_sock", None)
    return inner if hasattr(inner, "fileno") else sock


IOV_MAX = 1024  # Linux's limit on the buffers of one writev


def _unwritten(parts: list, n: int) -> list:
    """What is left of `parts` after the first `n` bytes went out: the first part left may be
    the tail of a part, as a memoryview (no copy)."""
    for i, part in enumerate(parts):
        size = len(part)
        if n < size:
            rest = parts[i:]
            if n:
                rest[0] = memoryview(part)[n:]
            return rest
        n -= size
    return []


def write_now(sock, parts: list) -> list:
    """Write what the socket takes now of `parts` (byte strings, in order), without blocking, and
    return what is left ([] when everything went). A full socket or an error writes nothing more:
    the writer task sends the rest and meets any error itself. The descriptor is read at each
    call: a closed socket's is -1 (never a number reused since)."""
    fd = sock.fileno() if sock is not None else -1
    while parts and fd >= 0:
        chunk = parts if len(parts) <= IOV_MAX else parts[:IOV_MAX]
        try:
            n = os.writev(fd, chunk)
        except OSError:  # BlockingIOError (full), or a broken connection the writer will report
            return parts
        if n < sum(map(len, chunk)):
            return _unwritten(parts, n)  # the socket is full
        parts = parts[len(chunk):]
    return parts


async def send_parts(stream, sock, parts: list) -> None:
    """The writer task's send: every part, waiting for room as needed. A socket is written with
    `writev` (the parts are never joined into one copy); other streams (the simulation's) get
    the joined bytes through `send_all`. Raises trio's Broken/ClosedResourceError as send_all."""
    if sock is None:
        await stream.send_all(parts[0] if len(parts) == 1 else b"".join(parts))
        return
    await trio.lowlevel.checkpoint_if_cancelled()
    while parts:
        fd = sock.fileno()
        if fd < 0:
            raise trio.ClosedResourceError("the connection was closed")
        chunk = parts if len(parts) <= IOV_MAX else parts[:IOV_MAX]
        try:
            n = os.writev(fd, chunk)
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)
            continue
        except OSError as exc:
            raise trio.BrokenResourceError(f"connection broken: {exc}") from exc
        parts = _unwritten(parts, n) if n < sum(map(len, chunk)) else parts[len(chunk):]


class DirectWrites:
    """How a connection's queued output leaves, for each of the three writers (the node's
    `Outbox` of the native protocol, the AMQP port's connection, the native client's writer):
    from the connection's writer task (`send`), or straight from the task that queued it
    (`write`) while the writer task has no send in flight and no earlier tail is pending
    (`can_write`). A direct write saves the writer task's wake-up, a pass of trio's scheduler.
    What the socket does not take at once stays in `rest`, and the writer task sends it before
    anything queued later, so bytes leave in the order they were queued."""

    __slots__ = ("sock", "sending", "rest")

    def __init__(self, sock=None) -> None:
        self.sock = sock  # None: every write is the writer task's (the simulation's streams)
        self.sending = False  # the writer task has a send in flight
        self.rest: list = []  # what a direct write did not get out

    def can_write(self) -> bool:
        return not self.sending and not self.rest and self.sock is not None

    def write(self, parts: list) -> bool:
        """Write `parts` now (only when `can_write()`); True if a tail is left for the writer
        task, which the caller then wakes."""
        rest = write_now(self.sock, parts)
        if rest:
            self.rest = rest
            return True
        return False

    async def send(self, stream, take) -> None:
        """The writer task's send: a direct write's tail first, then the parts `take()` returns
        (what was queued meanwhile: one write; None when nothing was)."""
        self.sending = True
        try:
            if self.rest:
                rest, self.rest = self.rest, []
                await send_parts(stream, self.sock, rest)
            parts = take()
            if parts:
                await send_parts(stream, self.sock, parts)
        finally:
            self.sending = False


class Outbox:
    """The single writer of a connection. `put` never blocks; `run` drains and sends.

    Output goes out from one of two places, never both at once (`DirectWrites`): the writer
    task (`run`), or `flush`, called at the end of a corked stretch (see Cork)."""

    HIGH_WATERMARK = 4096  # queued messages (each may be a batch) before data senders wait

    def __init__(self, framed: FramedStream):
        self.framed = framed
        self._items: list = []
        self._direct = DirectWrites(direct_socket(framed.stream))
        self._wake = trio.Event()
        self._held = False
        self._below = trio.Event()
        self._below.set()
        self.closed = False

    @property
    def _queued(self) -> int:
        return len(self._items) + bool(self._direct.rest)

    def put(self, msg) -> None:
        if self.closed:
            return
        items = self._items
        items.append(msg)
        if len(items) >= self.HIGH_WATERMARK and self._below.is_set():
            self._below = trio.Event()
        if not CORK.hold(self):
            self._wake.set()

    def flush(self) -> None:
        """End of a corked stretch: write what is queued now if the writer task is idle."""
        self._held = False
        if not self._items:
            return
        direct = self._direct
        if self.closed or not direct.can_write():
            self._wake.set()
            return
        if direct.write(self._take_parts()):
            self._wake.set()
        self._check_below()

    def _take_parts(self) -> list | None:
        """Everything queued, framed for one write (None if nothing is)."""
        if not self._items:
            return None
        batch, self._items = self._items, []
        return frame_parts(batch, self.framed.max_frame)

    @property
    def full(self) -> bool:
        """Past the high watermark: data senders should wait (`wait_below_watermark`)."""
        return not self._below.is_set()

    async def wait_below_watermark(self) -> None:
        while not self._below.is_set():
            await self._below.wait()

    def _check_below(self) -> None:
        if len(self._items) < self.HIGH_WATERMARK // 2 and not self._below.is_set():
            self._below.set()

    def close(self) -> None:
        """Stop accepting; `run` sends what is queued, then returns."""
        if not self.closed:
            self.closed = True
            self._wake.set()

    async def run(self) -> None:
        stream = self.framed.stream
        direct = self._direct
        try:
            while True:
                if not self._items and not direct.rest:
                    if self.closed:
                        return
                    await self._wake.wait()
                    self._wake = trio.Event()
                    continue
                # no waiting for more: an idle connection sends at once, and what is put while
                # a send is in flight (send_parts yields to the other tasks) forms the next batch
                await direct.send(stream, self._take_parts)
                self._check_below()
        finally:
            self.closed = True
            self._below.set()

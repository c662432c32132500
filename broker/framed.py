"""A trio stream carrying wire frames: batched reads and a batching writer.

`FramedStream.receive_batch()` returns every message decoded from one read, so a burst of small
frames costs one wake-up. `Outbox` is a connection's single writer: senders append messages
without waiting and the writer task encodes everything queued into one `send_all`. It sends as
soon as there is something to send; under load, what arrives during a send forms the next batch
(corking without a timer: measured against waiting up to 2 ms for the process to go idle, it
gave lower latency at 2,000 msgs/s and higher mirrored throughput). Senders on a
hot path call `wait_below_watermark()` so a slow reader back-pressures them instead of filling
memory.
"""

from __future__ import annotations

import math
import os

import trio

from wire.errors import UNEXPECTED_FRAME, FrameError, ProtocolError
from wire.frames import DEFAULT_MAX_FRAME, HEADER, FrameDecoder
from wire.schema import decode_bytes, encode

READ_SIZE = 256 * 1024


def _linger_setting() -> float | None:
    """WARREN_WRITER_LINGER, a knob for measuring writer policies (bench/README.md, "Writers"):
    unset, the writer sends at once (the default, measured best); 0, it first lets every ready
    task run once (one pass of the scheduler); a number of seconds, it first waits that long."""
    text = os.environ.get("WARREN_WRITER_LINGER", "").strip()
    return float(text) if text else None


LINGER = _linger_setting()


class FramedStream:
    def __init__(self, stream: trio.abc.Stream, max_frame: int = DEFAULT_MAX_FRAME):
        self.stream = stream
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
            data = await self.stream.receive_some(READ_SIZE)
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


def encode_many(msgs, max_frame: int) -> bytes:
    parts = []
    for m in msgs:
        body = encode(m)
        if len(body) > max_frame:
            raise FrameError(f"outgoing {m.KIND!r} frame of {len(body)} bytes exceeds the maximum frame size {max_frame}")
        parts.append(HEADER.pack(len(body)))
        parts.append(body)
    return b"".join(parts)


class Outbox:
    """The single writer of a connection. `put` never blocks; `run` drains and sends."""

    HIGH_WATERMARK = 4096  # queued messages (each may be a batch) before data senders wait

    def __init__(self, framed: FramedStream):
        self.framed = framed
        self._send, self._recv = trio.open_memory_channel(math.inf)
        self._queued = 0
        self._below = trio.Event()
        self._below.set()
        self.closed = False

    def put(self, msg) -> None:
        if self.closed:
            return
        self._queued += 1
        if self._queued >= self.HIGH_WATERMARK and self._below.is_set():
            self._below = trio.Event()
        self._send.send_nowait(msg)

    async def wait_below_watermark(self) -> None:
        while not self._below.is_set():
            await self._below.wait()

    def close(self) -> None:
        """Stop accepting; `run` sends what is queued, then returns."""
        if not self.closed:
            self.closed = True
            self._send.close()

    async def run(self) -> None:
        recv = self._recv
        try:
            async for first in recv:
                # no waiting for more: an idle connection sends at once, and what is put while
                # a send is in flight (send_all yields to the other tasks) forms the next batch
                if LINGER is not None:
                    await trio.sleep(LINGER)
                batch = [first]
                while True:
                    try:
                        batch.append(recv.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                await self.framed.stream.send_all(encode_many(batch, self.framed.max_frame))
                self._queued -= len(batch)
                if self._queued < self.HIGH_WATERMARK // 2:
                    self._below.set()
        finally:
            self.closed = True
            self._below.set()

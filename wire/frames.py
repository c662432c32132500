"""Framing: a 4-byte big-endian length, then exactly one msgpack value.

`encode_frame` turns a value into bytes; `FrameDecoder` is a sans-IO buffer that is fed
received bytes and hands back whole decoded values (generic msgpack values by default, typed
messages when given `wire.schema.decode_bytes`). Both enforce the maximum frame size, so a peer
can never make us buffer more than one maximum frame.
"""

from __future__ import annotations

import struct
import threading

import msgpack

from .errors import FrameError

HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME = 8 * 1024 * 1024  # 8 MiB
MIN_MAX_FRAME = 4096

_assembly = threading.local()  # .buf: the bytearray frames are assembled in (FrameDecoder)


def encode_frame(value, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """Encode one value as a frame; raises FrameError if it would exceed max_frame."""
    body = msgpack.packb(value, use_bin_type=True)
    if len(body) > max_frame:
        raise FrameError(f"frame of {len(body)} bytes exceeds the maximum frame size {max_frame}")
    return HEADER.pack(len(body)) + body


class FrameDecoder:
    """Feed bytes in, take decoded msgpack values out.

    Frames are decoded straight from the bytes fed in. Only a frame that is not whole yet is
    kept, as the pieces that came (no copy), until the bytes it needs have arrived; they are
    then copied once into a buffer kept for reuse (`_assembly`, one per thread). A large frame
    that arrives over many reads is copied once, not once per read, and the frames that come
    whole in one read are not copied at all.

    Why a kept buffer rather than `b"".join`: a peer link's replication batches are larger
    than one read, so every one of them is assembled. A fresh join of a few hundred KiB is
    fresh memory from the kernel each time (malloc gives large blocks back), and the kernel
    zeroes every page before the copy fills it: on a pure mirror under load that zeroing was a
    tenth of the process's CPU. Decoded values never point into the buffer (msgpack and msgspec
    copy what they return) and the start of a next frame left over is copied out, so it is free
    again once a feed returns. That is why one buffer serves every decoder of a thread: a node
    with thousands of connections keeps one, not one per connection."""

    ASSEMBLY_KEEP = 4 * 1024 * 1024  # larger frames are joined into fresh memory, not kept

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME, decode=None):
        self.max_frame = max_frame
        self._parts: list = []  # the start of a frame not whole yet
        self._have = 0  # bytes in _parts
        self._need = 0  # bytes that frame takes, header included (4 while the header is partial)
        self._decode = decode  # frame body bytes -> value; None: generic msgpack

    def _assemble(self):
        """The pieces of `_parts` as one buffer: a view of `_assembly`, or a fresh join."""
        parts, have = self._parts, self._have
        self._parts = []
        self._have = 0
        if have > self.ASSEMBLY_KEEP:
            return b"".join(parts)
        buf = getattr(_assembly, "buf", b"")
        if len(buf) < have:
            # replaced, never resized: a view of the old one may still be alive
            buf = _assembly.buf = bytearray(max(have, min(2 * len(buf), self.ASSEMBLY_KEEP), 64 * 1024))
        view = memoryview(buf)
        pos = 0
        for part in parts:
            end = pos + len(part)
            view[pos:end] = part
            pos = end
        return view[:have]

    def feed(self, data: bytes) -> list:
        """Add received bytes; return every complete value now available (maybe none)."""
        if self._parts:
            self._parts.append(data)
            self._have += len(data)
            if self._have < self._need:
                return []
            data = self._assemble()
        out = []
        pos = 0
        n = len(data)
        view = memoryview(data)
        try:
            while n - pos >= 4:
                (length,) = HEADER.unpack_from(data, pos)
                if length > self.max_frame:
                    raise FrameError(
                        f"frame length {length} exceeds the maximum frame size {self.max_frame}"
                    )
                if length == 0:
                    raise FrameError("empty frame (length 0)")
                end = pos + 4 + length
                if end > n:
                    break
                out.append(self._value(view[pos + 4 : end]))
                pos = end
            if pos < n:
                # keep the unfinished frame as it came: the bytes object itself, or a view of
                # its tail (a mutable buffer, which its owner may reuse, is copied)
                rest = data if pos == 0 else memoryview(data)[pos:]
                self._parts = [rest if type(data) is bytes else bytes(rest)]
                self._have = n - pos
                self._need = 4 + length if n - pos >= 4 else 4
        finally:
            view.release()
        return out

    def _value(self, body: memoryview):
        try:
            if self._decode is not None:
                return self._decode(body)
            try:
                return msgpack.unpackb(body, raw=False, strict_map_key=False)
            except Exception as exc:  # msgpack raises several types for garbage
                raise FrameError(f"frame body is not valid msgpack ({type(exc).__name__}: {exc})")
        finally:
            body.release()

    @property
    def pending(self) -> int:
        """Bytes received but not yet part of a whole frame."""
        return self._have

    def check_eof(self) -> None:
        """Call at end of stream: a partial frame left over is a truncation error."""
        if self._have:
            raise FrameError(f"connection closed in the middle of a frame ({self._have} bytes pending)")

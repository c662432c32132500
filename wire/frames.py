"""Framing: a 4-byte big-endian length, then exactly one msgpack value.

`encode_frame` turns a value into bytes; `FrameDecoder` is a sans-IO buffer that is fed
received bytes and hands back whole decoded values (generic msgpack values by default, typed
messages when given `wire.schema.decode_bytes`). Both enforce the maximum frame size, so a peer
can never make us buffer more than one maximum frame.
"""

from __future__ import annotations

import struct

import msgpack

from .errors import FrameError

HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME = 8 * 1024 * 1024  # 8 MiB
MIN_MAX_FRAME = 4096

_packer_default = msgpack.Packer(use_bin_type=True)


def encode_frame(value, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """Encode one value as a frame; raises FrameError if it would exceed max_frame."""
    body = msgpack.packb(value, use_bin_type=True)
    if len(body) > max_frame:
        raise FrameError(f"frame of {len(body)} bytes exceeds the maximum frame size {max_frame}")
    return HEADER.pack(len(body)) + body


def encoded_size(value) -> int:
    """Bytes a value takes on the wire, header included."""
    return HEADER.size + len(msgpack.packb(value, use_bin_type=True))


class FrameDecoder:
    """Feed bytes in, take decoded msgpack values out."""

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME, decode=None):
        self.max_frame = max_frame
        self._buf = bytearray()
        self._decode = decode  # frame body bytes -> value; None: generic msgpack

    def feed(self, data: bytes) -> list:
        """Add received bytes; return every complete value now available (maybe none)."""
        buf = self._buf
        buf += data
        out = []
        pos = 0
        n = len(buf)
        while n - pos >= 4:
            (length,) = HEADER.unpack_from(buf, pos)
            if length > self.max_frame:
                raise FrameError(
                    f"frame length {length} exceeds the maximum frame size {self.max_frame}"
                )
            if length == 0:
                raise FrameError("empty frame (length 0)")
            end = pos + 4 + length
            if end > n:
                break
            body = memoryview(buf)[pos + 4 : end]
            if self._decode is not None:
                try:
                    value = self._decode(body)
                finally:
                    body.release()
            else:
                try:
                    value = msgpack.unpackb(body, raw=False, strict_map_key=False)
                except Exception as exc:  # msgpack raises several types for garbage
                    raise FrameError(f"frame body is not valid msgpack ({type(exc).__name__}: {exc})")
                finally:
                    body.release()
            out.append(value)
            pos = end
        if pos:
            del buf[:pos]
        return out

    @property
    def pending(self) -> int:
        """Bytes received but not yet part of a whole frame."""
        return len(self._buf)

    def check_eof(self) -> None:
        """Call at end of stream: a partial frame left over is a truncation error."""
        if self._buf:
            raise FrameError(f"connection closed in the middle of a frame ({len(self._buf)} bytes pending)")

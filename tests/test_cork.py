"""broker/framed.py's Cork and Outbox on real sockets: output produced in a corked stretch is
written straight from the producing task at the stretch's end (no writer task involved), in
order with what the writer task sends, and a write the socket takes only in part hands the
rest to the writer task."""

from __future__ import annotations

import socket

import trio

from broker.framed import CORK, FramedStream, Outbox
from wire import messages as m
from wire.frames import DEFAULT_MAX_FRAME


def stream_pair():
    a, b = socket.socketpair()
    return trio.SocketStream(trio.socket.from_stdlib_socket(a)), trio.SocketStream(trio.socket.from_stdlib_socket(b))


async def read_messages(stream, n: int) -> list:
    framed = FramedStream(stream, DEFAULT_MAX_FRAME)
    got: list = []
    with trio.fail_after(10):
        while len(got) < n:
            batch = await framed.receive_batch()
            assert batch, "stream ended early"
            got.extend(batch)
    return got


async def test_corked_output_is_written_at_the_end_of_the_stretch_without_a_writer_task():
    left, right = stream_pair()
    outbox = Outbox(FramedStream(left, DEFAULT_MAX_FRAME))
    # no writer task runs: only the cork's flush can put these on the wire
    with CORK:
        outbox.put(m.Tick())
        outbox.put(m.Tick())
        assert outbox._queued == 2  # held until the stretch ends
    assert outbox._queued == 0
    got = await read_messages(right, 2)
    assert [type(x) for x in got] == [m.Tick, m.Tick]


async def test_uncorked_output_waits_for_the_writer_task():
    left, right = stream_pair()
    outbox = Outbox(FramedStream(left, DEFAULT_MAX_FRAME))
    outbox.put(m.Tick())
    assert outbox._queued == 1
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outbox.run)
        got = await read_messages(right, 1)
        assert type(got[0]) is m.Tick
        outbox.close()


async def test_a_partial_direct_write_leaves_the_rest_to_the_writer_in_order():
    left, right = stream_pair()
    left.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    outbox = Outbox(FramedStream(left, DEFAULT_MAX_FRAME))
    body = b"x" * 1000
    n = 2000  # about 2 MB: far more than the socket takes at once
    with CORK:
        for i in range(n):
            outbox.put(m.Publish(1, f"q{i}", [body], None))
    assert outbox._direct.rest, "the socket should have taken only part of the write"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outbox.run)
        # more output while the rest is pending: it must follow, not overtake
        with CORK:
            outbox.put(m.Tick())
        got = await read_messages(right, n + 1)
        assert [x.queue for x in got[:n]] == [f"q{i}" for i in range(n)]
        assert type(got[n]) is m.Tick
        outbox.close()


async def test_a_closed_outbox_is_not_written_directly():
    left, right = stream_pair()
    outbox = Outbox(FramedStream(left, DEFAULT_MAX_FRAME))
    with CORK:
        outbox.put(m.Tick())
        outbox.close()  # closing: what is queued goes through the writer task only
    assert outbox._queued == 1
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outbox.run)
        got = await read_messages(right, 1)
        assert type(got[0]) is m.Tick


async def test_a_message_encoded_once_goes_out_as_the_same_bytes():
    from broker.framed import Encoded, encode_many

    msg = m.Publish(1, "q", [b"a" * 100, b"b"], None)
    assert encode_many([Encoded(msg, DEFAULT_MAX_FRAME), m.Tick()], DEFAULT_MAX_FRAME) == \
        encode_many([msg, m.Tick()], DEFAULT_MAX_FRAME)
    left, right = stream_pair()
    outbox = Outbox(FramedStream(left, DEFAULT_MAX_FRAME))
    with CORK:
        outbox.put(Encoded(msg, DEFAULT_MAX_FRAME))
    got = await read_messages(right, 1)
    assert got == [msg]


def test_what_a_write_leaves_is_the_tail_of_the_parts_without_copies():
    from broker.framed import _unwritten

    parts = [b"abc", b"defg", b"h"]
    assert _unwritten(parts, 0) == parts
    assert [bytes(p) for p in _unwritten(parts, 2)] == [b"c", b"defg", b"h"]
    assert _unwritten(parts, 3) == [b"defg", b"h"]
    assert [bytes(p) for p in _unwritten(parts, 7)] == [b"h"]
    assert _unwritten(parts, 8) == []


async def test_the_writer_sends_more_parts_than_one_writev_takes_in_order():
    from broker.framed import IOV_MAX, send_parts

    left, right = stream_pair()
    left.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    parts = [bytes([i % 251]) * (1 + i % 7) for i in range(3 * IOV_MAX + 5)]
    want = b"".join(parts)
    got = bytearray()

    async def read_all():
        while len(got) < len(want):
            got.extend(await right.receive_some(65536))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_all)
        with trio.fail_after(10):
            await send_parts(left, left.socket, parts)
    assert bytes(got) == want

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
    assert outbox._rest, "the socket should have taken only part of the write"
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

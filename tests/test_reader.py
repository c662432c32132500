"""broker/framed.py's Reader on real sockets: a read that finds data returns it without a pass
of trio's scheduler, a stream that always has data still lets other tasks run, a cancelled read
takes no bytes, a read that emptied the socket is followed by a wait rather than a failed
read, and the ends of a connection read as trio's stream errors."""

from __future__ import annotations

import os
import socket
import struct

import pytest
import trio

from broker.framed import Reader


def stream_pair(kind=socket.AF_UNIX):
    if kind == socket.AF_UNIX:
        a, b = socket.socketpair()
    else:
        lst = socket.create_server(("127.0.0.1", 0))
        a = socket.create_connection(lst.getsockname())
        b, _ = lst.accept()
        lst.close()
    return trio.SocketStream(trio.socket.from_stdlib_socket(a)), b


async def test_a_read_that_finds_data_does_not_yield_to_the_scheduler():
    left, right = stream_pair()
    reader = Reader(left)
    ran = []

    async def note():
        ran.append(1)

    right.send(b"hello")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(note)
        # the new task is runnable; a read with data there must not let it run first
        assert await reader.receive_some(100) == b"hello"
        assert ran == []
    assert ran == [1]
    right.close()


async def test_a_stream_that_always_has_data_lets_other_tasks_run():
    left, right = stream_pair()
    reader = Reader(left)
    right.send(b"x" * 1000)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await trio.sleep(0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        for _ in range(10 * Reader.STREAK):
            assert await reader.receive_some(1) == b"x"
        nursery.cancel_scope.cancel()
    assert ticks >= 5  # one pass every STREAK reads (none at all would starve it)


async def test_a_cancelled_read_takes_no_bytes():
    left, right = stream_pair()
    reader = Reader(left)
    right.send(b"abc")
    reader._streak = Reader.STREAK  # the next read checkpoints first
    with trio.CancelScope() as scope:
        scope.cancel()
        await reader.receive_some(100)
    assert scope.cancelled_caught
    assert await reader.receive_some(100) == b"abc"


async def test_a_read_waits_for_data():
    left, right = stream_pair()
    reader = Reader(left)
    async with trio.open_nursery() as nursery:
        async def later():
            await trio.sleep(0.05)
            right.send(b"late")
        nursery.start_soon(later)
        with trio.fail_after(5):
            assert await reader.receive_some(100) == b"late"


async def test_end_of_stream_reset_and_close_read_as_stream_errors():
    left, right = stream_pair()
    reader = Reader(left)
    right.close()
    assert await reader.receive_some(100) == b""  # a clean end

    left, right = stream_pair(socket.AF_INET)
    reader = Reader(left)
    right.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    right.close()  # a reset
    with trio.fail_after(5), pytest.raises(trio.BrokenResourceError):
        while await reader.receive_some(100):
            pass

    left, right = stream_pair()
    reader = Reader(left)
    async with trio.open_nursery() as nursery:
        async def close_soon():
            await trio.sleep(0.05)
            await left.aclose()
        nursery.start_soon(close_soon)
        with trio.fail_after(5), pytest.raises(trio.ClosedResourceError):
            await reader.receive_some(100)  # waiting when the connection is closed
    with pytest.raises(trio.ClosedResourceError):
        await reader.receive_some(100)  # and after
    right.close()


async def test_other_streams_are_read_with_receive_some():
    a, b = trio.testing.memory_stream_pair()
    reader = Reader(a)
    await b.send_all(b"sim")
    assert await reader.receive_some(100) == b"sim"


async def test_a_peer_link_reads_through_the_reader():
    from broker.framed import FramedStream, encode_many
    from wire import messages as msgs
    from wire.frames import DEFAULT_MAX_FRAME

    left, right = stream_pair()
    framed = FramedStream(left, DEFAULT_MAX_FRAME)
    ran = []

    async def note():
        ran.append(1)

    right.send(encode_many([msgs.Tick(), msgs.Tick()], DEFAULT_MAX_FRAME))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(note)
        assert len(await framed.receive_batch()) == 2
        assert ran == []  # no pass of the scheduler before the messages are handled
    right.close()


async def test_a_read_that_emptied_the_socket_is_followed_by_a_wait_not_a_failed_read(monkeypatch):
    """A read that took less than it asked for found the socket empty then: the next read waits
    for the socket instead of trying it first (a failed read is a system call and an exception
    at every wake-up of a node). The bytes still all arrive, in order; a read that filled its
    buffer reads again at once."""
    left, right = stream_pair()
    reader = Reader(left)
    failed = []
    real_read = os.read

    def counting_read(fd, n):
        try:
            return real_read(fd, n)
        except BlockingIOError:
            failed.append(fd)
            raise

    monkeypatch.setattr(os, "read", counting_read)
    right.send(b"first")
    assert await reader.receive_some(100) == b"first"

    async def later():
        await trio.sleep(0.01)
        right.send(b"second")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(later)
        assert await reader.receive_some(100) == b"second"
    assert failed == []
    right.send(b"abcdef")
    assert await reader.receive_some(3) == b"abc"  # a full buffer: more may be there
    assert await reader.receive_some(3) == b"def"
    assert failed == []
    right.close()

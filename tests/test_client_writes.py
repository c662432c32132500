"""The native client's direct writes (broker/client/aio.py `_Writer`): a consumer's acks, sent by
the reader when it is about to wait (the acks of several reads in a row together), and a
producer's burst ended with `Connection.flush()` or made inside `with conn.corked():`, go out
straight from the task that made them, without the connection's writer task (and, corked,
without waking it); publishes without a flush are left to that task;
while it has a send in flight, or the socket takes only part of a write, everything still goes
out, in order, through that task.

The node side is a few lines of raw sockets speaking the peer protocol's frames, so the test can
see each frame the client writes and count the writer task's sends."""

from __future__ import annotations

import socket

import trio

from broker import framed
from broker.client import aio
from broker.framed import FramedStream, encode_many
from wire import messages as m
from wire.frames import DEFAULT_MAX_FRAME


class FakeNode:
    """Accepts one client, answers its handshake and requests, and records what it sends."""

    def __init__(self, listener):
        self.listener = listener
        self.port = listener.socket.getsockname()[1]
        self.framed: FramedStream | None = None
        self.got: list = []
        self.arrived = trio.Event()

    async def serve(self):
        stream = await self.listener.accept()
        framed = self.framed = FramedStream(stream, DEFAULT_MAX_FRAME)
        await framed.send_now(m.Hello(m.PROTOCOL_VERSION, "n1", b"x" * 16, DEFAULT_MAX_FRAME))
        assert type(await framed.receive(frozenset({"client.auth"}))) is m.ClientAuth
        await framed.send_now(m.Welcome("n1", "c", DEFAULT_MAX_FRAME))
        while True:
            batch = await framed.receive_batch()
            if not batch:
                return
            for msg in batch:
                if hasattr(msg, "rid"):
                    value = "ctag" if type(msg) is m.BasicConsume else None
                    await framed.send_now(m.Reply(msg.rid, value))
                else:
                    self.got.append(msg)
                    self.arrived.set()

    async def wait_for(self, kind, count: int) -> list:
        with trio.fail_after(10):
            while sum(len(getattr(x, "tags", getattr(x, "bodies", []))) for x in self.got if type(x) is kind) < count:
                self.arrived = trio.Event()
                await self.arrived.wait()
        return [x for x in self.got if type(x) is kind]


def count_writer_wakes(monkeypatch) -> list:
    """Each time queuing something woke the client's writer task (a pass of trio's scheduler)."""
    wakes: list = []

    class CountingWriter(aio._Writer):
        def _queued(self):
            was = self.wake.is_set()
            super()._queued()
            if self.wake.is_set() and not was:
                wakes.append(len(self.items))

    monkeypatch.setattr(aio, "_Writer", CountingWriter)
    return wakes


def count_writer_sends(monkeypatch) -> list:
    """Each send of the client's writer task, as the number of parts it wrote (the fake node
    sends with `send_now`, never through `send_parts`)."""
    sends: list = []
    real = framed.send_parts

    async def counting(stream, sock, parts):
        sends.append(len(parts))
        await real(stream, sock, parts)

    monkeypatch.setattr(framed, "send_parts", counting)
    return sends


async def with_node(body):
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    node = FakeNode(listener)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(node.serve)
        async with aio.open_connection(f"127.0.0.1:{node.port}", reconnect=False) as conn:
            await body(node, conn)
            conn.closing = True  # the fake node does not answer a close: just hang up
            conn._nursery.cancel_scope.cancel()
        nursery.cancel_scope.cancel()


async def test_a_consumers_acks_for_one_read_go_out_from_the_reader_in_one_frame(monkeypatch):
    sends = count_writer_sends(monkeypatch)
    wakes = count_writer_wakes(monkeypatch)

    async def body(node, conn):
        ch = await conn.channel()
        seen: list[int] = []

        def on_message(channel, msg):
            seen.append(msg.delivery_tag)
            channel.basic_ack(msg.delivery_tag)

        await ch.basic_consume("q", on_message_callback=on_message)
        await trio.testing.wait_all_tasks_blocked()
        sends.clear()
        wakes.clear()
        # three deliveries arrive in one read: their three acks leave as one Ack frame, written
        # by the reader at the end of the read, not by the writer task
        await node.framed.stream.send_all(encode_many(
            [m.Deliver(ch.ch, "ctag", 1, [b"a", b"b"], [], None, None), m.Deliver(ch.ch, "ctag", 3, [b"c"], [], None, None)],
            DEFAULT_MAX_FRAME))
        acks = await node.wait_for(m.Ack, 3)
        assert seen == [1, 2, 3]
        assert [a.tags for a in acks] == [[1, 2, 3]]
        assert sends == [] and wakes == []  # the writer task was neither woken nor used

    await with_node(body)


async def test_acks_of_several_reads_in_a_row_leave_together_when_the_reader_waits(monkeypatch):
    from broker import framed as framed_mod

    sends = count_writer_sends(monkeypatch)
    monkeypatch.setattr(framed_mod, "READ_SIZE", 16)  # each delivery below takes several reads
    monkeypatch.setattr(framed_mod.Reader, "STREAK", 1000)

    async def body(node, conn):
        ch = await conn.channel()
        await ch.basic_consume("q", on_message_callback=lambda channel, msg: channel.basic_ack(msg.delivery_tag))
        await trio.testing.wait_all_tasks_blocked()
        sends.clear()
        await node.framed.stream.send_all(encode_many(
            [m.Deliver(ch.ch, "ctag", 1, [b"a" * 40], [], None, None), m.Deliver(ch.ch, "ctag", 2, [b"b" * 40], [], None, None)],
            DEFAULT_MAX_FRAME))
        acks = await node.wait_for(m.Ack, 2)
        # two reads handled a delivery each; the acks left once, when the socket was empty
        assert [a.tags for a in acks] == [[1, 2]]
        assert sends == []

    await with_node(body)


async def settled_channel(conn, sends: list):
    """A new channel, once the client is idle again, with the writer's sends counted from here."""
    ch = await conn.channel()
    await trio.testing.wait_all_tasks_blocked()
    sends.clear()
    return ch


async def test_a_producers_flush_sends_its_burst_without_the_writer_task(monkeypatch):
    sends = count_writer_sends(monkeypatch)

    async def body(node, conn):
        ch = await settled_channel(conn, sends)
        for i in range(5):
            ch.publish_nowait("q", b"%d" % i)
        conn.flush()  # before any checkpoint: the writer task has had no chance to run
        assert not conn._writer.items
        publishes = await node.wait_for(m.Publish, 5)
        assert [b for p in publishes for b in p.bodies] == [b"0", b"1", b"2", b"3", b"4"]
        assert sends == []

    await with_node(body)


async def test_without_a_flush_the_writer_task_sends(monkeypatch):
    sends = count_writer_sends(monkeypatch)

    async def body(node, conn):
        ch = await settled_channel(conn, sends)
        ch.publish_nowait("q", b"x")
        await node.wait_for(m.Publish, 1)
        assert len(sends) == 1

    await with_node(body)


async def test_a_flush_during_a_send_in_flight_leaves_everything_to_the_writer_in_order(monkeypatch):
    async def body(node, conn):
        ch = await conn.channel()
        w = conn._writer
        w.direct.sending = True  # as if the writer task were waiting for room in the socket
        ch.publish_nowait("q", b"first")
        conn.flush()
        assert list(w.items), "a direct write must not overtake a send in flight"
        w.direct.sending = False
        publishes = await node.wait_for(m.Publish, 1)
        assert publishes[0].bodies == [b"first"]

    await with_node(body)


async def test_a_partial_direct_write_leaves_the_rest_to_the_writer_task_in_order():
    async def body(node, conn):
        ch = await conn.channel()
        await trio.testing.wait_all_tasks_blocked()
        w = conn._writer
        w.direct.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        n = 3000  # about 3 MB of publishes: far more than the socket takes at once
        for i in range(n):
            ch.publish_nowait(f"q{i}", b"y" * 1000)
        conn.flush()
        assert w.direct.rest, "the socket should have taken only part of the write"
        ch.publish_nowait("last", b"z")  # queued behind the rest: must not overtake it
        publishes = await node.wait_for(m.Publish, n + 1)
        assert [p.queue for p in publishes] == [f"q{i}" for i in range(n)] + ["last"]

    await with_node(body)


async def test_a_corked_burst_neither_wakes_nor_uses_the_writer_task(monkeypatch):
    sends = count_writer_sends(monkeypatch)
    wakes = count_writer_wakes(monkeypatch)

    async def body(node, conn):
        ch = await settled_channel(conn, sends)
        wakes.clear()
        with conn.corked():
            await ch.basic_publish("", "q", b"0")
            for i in range(1, 5):
                ch.publish_nowait("q", b"%d" % i)
            assert conn._writer.items  # held until the block ends
        assert not conn._writer.items  # written at its end, from this task
        publishes = await node.wait_for(m.Publish, 5)
        assert [b for p in publishes for b in p.bodies] == [b"0", b"1", b"2", b"3", b"4"]
        assert sends == [] and wakes == []  # (a flush alone still wakes the writer, for nothing)

    await with_node(body)


async def test_a_publish_that_waits_for_room_in_a_corked_block_sends_what_is_held_first(monkeypatch):
    """A corked block whose publishes fill the client's send buffer: `basic_publish` waits for
    room, and the room comes only once what the block holds is written: it must be sent, not
    wait for the block's end (which would never come)."""
    async def body(node, conn):
        ch = await settled_channel(conn, [])
        body_ = b"y" * 4096
        n = 8 * aio.MAX_BATCH_BYTES // len(body_) + 10  # past the buffer's high mark
        with trio.fail_after(10):
            with conn.corked():
                for i in range(n):
                    ch.publish_nowait("q", body_)
                assert not conn._writer.room.is_set()
                await ch.basic_publish("", "q", b"last")
        publishes = await node.wait_for(m.Publish, n + 1)
        assert [b for p in publishes for b in p.bodies][-1] == b"last"

    await with_node(body)

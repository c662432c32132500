"""The AMQP load generator's client (bench/amqp.py) and the null broker (bench/nullbroker.py):
the hot-path shortcuts give exactly pamqp's bytes and values, and a real exchange over TCP works
(confirms, deliveries, acks, a frame-split body, a broker-closed channel)."""

import asyncio
import struct

import pytest

pamqp = pytest.importorskip("pamqp")

from pamqp import body as pbody  # noqa: E402
from pamqp import commands as C  # noqa: E402
from pamqp import frame as pframe  # noqa: E402
from pamqp import header as pheader  # noqa: E402

from bench import amqp  # noqa: E402
from bench.nullbroker import serve  # noqa: E402


def _pamqp_publish(channel, queue, body, frame_max):
    out = pframe.marshal(C.Basic.Publish(exchange="", routing_key=queue), channel)
    out += pframe.marshal(pheader.ContentHeader(0, len(body), C.Basic.Properties()), channel)
    room = frame_max - 8
    for k in range(0, len(body), room):
        out += pframe.marshal(pbody.ContentBody(body[k:k + room]), channel)
    return out


@pytest.mark.parametrize("size,frame_max", [(8, 131072), (1024, 131072), (300_000, 131072), (5000, 4096)])
def test_publish_template_is_pamqps_publish(size, frame_max):
    head, tail = amqp.publish_frames(3, "bench.q.7", size, frame_max)
    ident = (0x1234 << 40 | 99).to_bytes(8, "big")
    body = ident + bytes(size - 8)
    assert head + ident + tail == _pamqp_publish(3, "bench.q.7", body, frame_max)


def test_ack_frame_is_pamqps_ack():
    for tag, multiple in ((1, False), (2 ** 40 + 5, True)):
        assert amqp.ack_frame(amqp.ack_prefix(2), tag, multiple) == pframe.marshal(
            C.Basic.Ack(delivery_tag=tag, multiple=multiple), 2)


def test_received_deliveries_and_confirms_decode_like_pamqp():
    async def go():
        conn = amqp.Connection()
        ch = amqp.Channel(conn, 1)
        ch.is_open = True
        conn.channels[1] = ch
        got, confirms = [], []
        ch.on_delivery = lambda tag, red, body: got.append((tag, red, bytes(body)))
        ch.on_confirm = lambda tag, multiple, ok: confirms.append((tag, multiple, ok))
        big = bytes(range(256)) * 40  # 10,240 bytes in three body frames
        stream = b"".join([
            pframe.marshal(C.Basic.Deliver(consumer_tag="ctag-1", delivery_tag=7, redelivered=True,
                                           exchange="", routing_key="q"), 1),
            pframe.marshal(pheader.ContentHeader(0, 5, C.Basic.Properties(headers={"x": 1})), 1),
            pframe.marshal(pbody.ContentBody(b"hello"), 1),
            pframe.marshal(C.Basic.Ack(delivery_tag=40, multiple=True), 1),
            pframe.marshal(C.Basic.Nack(delivery_tag=41, multiple=False, requeue=False), 1),
            pframe.marshal(C.Basic.Deliver(consumer_tag="c", delivery_tag=2 ** 33, redelivered=False,
                                           exchange="ex", routing_key="rk"), 1),
            pframe.marshal(pheader.ContentHeader(0, len(big), C.Basic.Properties()), 1),
            pframe.marshal(pbody.ContentBody(big[:4000]), 1),
            pframe.marshal(pbody.ContentBody(big[4000:8000]), 1),
            pframe.marshal(pbody.ContentBody(big[8000:]), 1),
        ])
        # byte by byte: frames split anywhere across reads
        for k in range(0, len(stream), 13):
            conn.data_received(stream[k:k + 13])
        assert got == [(7, True, b"hello"), (2 ** 33, False, big)]
        assert confirms == [(40, True, True), (41, False, False)]

    asyncio.run(go())


def test_a_real_exchange_with_the_null_broker():
    async def go():
        from broker.localcluster import free_port
        port = free_port()
        server = asyncio.create_task(serve("127.0.0.1", [port]))
        for _ in range(100):
            try:
                conn = await amqp.Connection.connect("127.0.0.1", port, name="test")
                break
            except OSError:
                await asyncio.sleep(0.02)
        pub = await conn.channel()
        await pub.confirm_select()
        await pub.queue_declare("t.q")
        confirmed = []
        pub.on_confirm = lambda tag, multiple, ok: confirmed.append((tag, multiple, ok))
        head, tail = pub.publish_template("t.q", 200_000)  # spans two body frames
        conn.send_many([head + i.to_bytes(8, "big") + tail for i in range(50)])
        cons = await conn.channel()
        await cons.basic_qos(10)
        ids = []

        def on_delivery(tag, red, body):
            ids.append(int.from_bytes(body[:8], "big"))
            assert len(body) == 200_000
            cons.ack_later(tag)  # one multiple ack per read

        cons.on_delivery = on_delivery
        await cons.basic_consume("t.q")
        for _ in range(500):
            if len(ids) == 50 and confirmed and confirmed[-1][0] == 50:
                break
            await asyncio.sleep(0.01)
        assert ids == list(range(50))
        assert confirmed[-1] == (50, True, True)
        await conn.close()
        assert conn.is_closed
        server.cancel()

    asyncio.run(go())


def test_a_channel_closed_by_the_broker_fails_its_waiter():
    async def go():
        conn = amqp.Connection()
        ch = amqp.Channel(conn, 1)
        ch.is_open = True
        conn.channels[1] = ch
        sent = []

        class T:
            def write(self, data):
                sent.append(data)

            def is_closing(self):
                return False

        conn.transport = T()
        reasons = []
        ch.on_close = reasons.append
        waiter = asyncio.ensure_future(ch.queue_declare("nope"))
        await asyncio.sleep(0)
        conn.data_received(pframe.marshal(C.Channel.Close(reply_code=404, reply_text="NOT_FOUND - no queue",
                                                          class_id=50, method_id=10), 1))
        with pytest.raises(amqp.AMQPError, match="404"):
            await waiter
        assert not ch.is_open and reasons == ["404 NOT_FOUND - no queue"]
        # it answered close-ok
        assert any(struct.unpack(">I", d[7:11])[0] == C.Channel.CloseOk.index for d in sent)

    asyncio.run(go())


@pytest.mark.process
def test_the_floor_confirms_only_what_every_mirror_counted():
    """The `floor` target, a mirrored null broker on trio: real processes (the broker and two
    mirrors). With one mirror stopped (SIGSTOP), deliveries still flow but no confirm comes; once
    it runs again, every publish is confirmed. The consumer's acks, sent to the mirrors
    meanwhile, do not upset their counts."""
    import os
    import signal

    from bench.targets import NullTarget

    target = NullTarget(mirrors=2)
    target.start()
    try:
        assert target.name == "floor"
        assert [target.pid(n) for n in target.nodes] == [target.proc.pid] + [p.pid for p in target.mirror_procs]

        async def go():
            conn = await amqp.Connection.connect("127.0.0.1", target.ports[0], name="test")
            pub = await conn.channel()
            await pub.confirm_select()
            await pub.queue_declare("m.q")
            confirmed = []
            pub.on_confirm = lambda tag, multiple, ok: confirmed.append(tag)
            head, tail = pub.publish_template("m.q", 1024)
            cons = await conn.channel()
            await cons.basic_qos(100)
            ids = []

            def on_delivery(tag, red, body):
                ids.append(int.from_bytes(body[:8], "big"))
                cons.ack_later(tag)

            cons.on_delivery = on_delivery
            await cons.basic_consume("m.q")

            async def until(cond, what, timeout=5.0):
                for _ in range(int(timeout / 0.01)):
                    if cond():
                        return
                    await asyncio.sleep(0.01)
                raise AssertionError(f"timed out waiting for {what}: confirmed {confirmed[-1:]}, delivered {len(ids)}")

            conn.send_many([head + i.to_bytes(8, "big") + tail for i in range(20)])
            await until(lambda: confirmed and confirmed[-1] == 20 and len(ids) == 20, "the first 20")
            os.kill(target.mirror_procs[1].pid, signal.SIGSTOP)
            try:
                conn.send_many([head + i.to_bytes(8, "big") + tail for i in range(20, 30)])
                await until(lambda: len(ids) == 30, "deliveries with a mirror stopped")
                await asyncio.sleep(0.3)
                assert confirmed[-1] == 20, "a confirm came before every mirror had the message"
            finally:
                os.kill(target.mirror_procs[1].pid, signal.SIGCONT)
            await until(lambda: confirmed[-1] == 30, "the confirms once the mirror ran again")
            conn.send_many([head + i.to_bytes(8, "big") + tail for i in range(30, 40)])
            await until(lambda: confirmed[-1] == 40 and len(ids) == 40, "ten more")
            assert ids == list(range(40))
            # a body larger than a socket takes at once, through the broker and to both mirrors,
            # with small ones right behind it: what is written while the big one drains must
            # follow it, not cut into it
            big_head, big_tail = pub.publish_template("m.q", 4_000_000)
            conn.send_many([big_head + (40).to_bytes(8, "big") + big_tail]
                           + [head + i.to_bytes(8, "big") + tail for i in range(41, 61)])
            await until(lambda: confirmed[-1] == 61 and len(ids) == 61, "a 4 MB message and 20 after it")
            assert ids == list(range(61))
            await conn.close()

        asyncio.run(go())
    finally:
        target.stop()
    assert target.proc is None and not target.mirror_procs


def test_the_null_brokers_acks_for_the_mirrors_do_not_pile_up_without_publishes():
    from bench.nullbroker import ACKS_HELD, Broker, _MirrorLink

    broker = Broker()
    link = _MirrorLink(broker)
    broker.mirrors.append(link)
    for tag in range(1, ACKS_HELD):
        broker.mirror_ack(tag, False)
    assert not link.publishes  # they wait for a publish to ride with
    broker.mirror_ack(ACKS_HELD, False)
    assert link.publishes  # ... but not beyond ACKS_HELD: the next flush writes them


def test_the_trio_null_transport_keeps_bytes_in_order_while_it_drains():
    """A write the socket does not take at once is drained by a task; what is written while it
    drains must follow it (a socketpair with small buffers forces the partial write)."""
    import socket

    import trio

    from bench.nullbroker import _TrioTransport

    async def go():
        a, b = socket.socketpair()
        for s in (a, b):
            s.setblocking(False)
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        big, small = bytes(range(256)) * 4096, b"after the big one"
        got = bytearray()
        async with trio.open_nursery() as nursery:
            t = _TrioTransport(a, nursery)
            t.write(big)
            assert t.draining, "the socket took 1 MiB at once: the test needs a partial write"
            await trio.sleep(0.01)  # the drain task is now waiting for room
            t.write(small)
            while len(got) < len(big) + len(small):
                try:
                    got += b.recv(65536)
                except BlockingIOError:
                    await trio.sleep(0.001)
        assert bytes(got) == big + small
        a.close()
        b.close()

    trio.run(go)

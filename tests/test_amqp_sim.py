"""The AMQP front end in a simulated cluster (in-process, SimNetwork under MockClock), driven by a
bare pamqp client over the simulated streams: the users and the loopback rule, connection.blocked
while credit flow holds a publisher behind a stalled mirror (and unblocked after), and a node that
pauses (pause_minority) closing its AMQP connections and refusing new ones."""

from __future__ import annotations

import gc
import json

import pytest
import trio
from pamqp import body as pbody
from pamqp import commands as C
from pamqp import frame, header

from broker.amqp import codec
from broker.amqp import protocol as amqp_protocol
from broker.control import ctl_call
from broker.session import WINDOW_MSGS

from broker.simulation import PEER_PORT, sim_cluster

pytestmark = pytest.mark.timeout(60)
AMQP_PORT = 5673  # the default


class SimAmqp:
    """A bare AMQP client on the simulated network."""

    def __init__(self, stream):
        self.stream = stream
        self.reader = codec.FrameReader(1 << 20)
        self.got: list = []

    @classmethod
    async def connect(cls, c, node, from_host=None, user="guest", password="guest", expect_open=True,
                      heartbeat=0):
        stream = await c.net.host(from_host or node).connect(node, AMQP_PORT)
        self = cls(stream)
        await self.send(codec.PROTOCOL_HEADER)
        await self.expect(C.Connection.Start)
        await self.method(0, C.Connection.StartOk({"capabilities": {
            "authentication_failure_close": True, "connection.blocked": True}}, "PLAIN", f"\0{user}\0{password}"))
        tune = await self.next()
        if not isinstance(tune, C.Connection.Tune):
            return self, tune
        await self.method(0, C.Connection.TuneOk(0, 131072, heartbeat))
        await self.method(0, C.Connection.Open("/"))
        return self, await self.next()

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def method(self, ch, method) -> None:
        await self.send(frame.marshal(method, ch))

    async def next(self, timeout: float = 30):
        with trio.fail_after(timeout):
            while not self.got:
                data = await self.stream.receive_some(1 << 20)
                if not data:
                    return None
                for kind, ch, payload in self.reader.feed(data):
                    whole = codec.FRAME_HEAD.pack(kind, ch, len(payload)) + payload + codec.FRAME_END_CHAR
                    self.got.append(frame.unmarshal(whole)[2])
        return self.got.pop(0)

    async def expect(self, cls, timeout: float = 30):
        while True:
            obj = await self.next(timeout)
            if isinstance(obj, cls):
                return obj
            if obj is None or isinstance(obj, (C.Connection.Close, C.Channel.Close)):
                raise AssertionError(f"expected {cls.__name__}, got {obj!r} {getattr(obj, 'reply_text', '')}")


async def test_users_and_the_loopback_rule(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path, users={"guest": "guest", "app": "secret"}) as c:
        _, close = await SimAmqp.connect(c, "n1", from_host="elsewhere")
        assert isinstance(close, C.Connection.Close) and close.reply_code == 403
        assert "user 'guest' can only connect via localhost" in close.reply_text
        _, close = await SimAmqp.connect(c, "n1", from_host="elsewhere", user="app", password="wrong")
        assert close.reply_code == 403 and "wrong user name or password" in close.reply_text
        _, ok = await SimAmqp.connect(c, "n1", from_host="elsewhere", user="app", password="secret")
        assert isinstance(ok, C.Connection.OpenOk)
        _, ok = await SimAmqp.connect(c, "n1")  # guest from the node's own host
        assert isinstance(ok, C.Connection.OpenOk)


async def test_blocked_while_credit_flow_holds_the_publisher(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        await ctl_call(c.net.host("n1"), "n1", PEER_PORT, "test", b"s", "set_policy",
                       {"name": "ha", "pattern": "^ha", "definition": json.dumps({"ha-mode": "all"})})
        client, ok = await SimAmqp.connect(c, "n1")
        assert isinstance(ok, C.Connection.OpenOk)
        await client.method(1, C.Channel.Open())
        await client.expect(C.Channel.OpenOk)
        await client.method(1, C.Queue.Declare(0, "ha.q"))
        await client.expect(C.Queue.DeclareOk)
        await trio.sleep(1)
        c.net.delay("n1", "n3", 5.0)  # a mirror far behind: nothing can be confirmed meanwhile
        one = (frame.marshal(C.Basic.Publish(0, "", "ha.q"), 1)
               + frame.marshal(header.ContentHeader(0, 1, C.Basic.Properties()), 1)
               + frame.marshal(pbody.ContentBody(b"x"), 1))
        for _ in range((WINDOW_MSGS + 1000) // 1000):
            await client.send(one * 1000)
        blocked = await client.expect(C.Connection.Blocked)
        assert "credit flow" in blocked.reason
        await client.expect(C.Connection.Unblocked)  # the mirror caught up


async def test_a_paused_node_closes_and_refuses_amqp_connections(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        client, ok = await SimAmqp.connect(c, "n1")
        assert isinstance(ok, C.Connection.OpenOk)
        c.net.partition(["n1"], ["n2", "n3"])
        close = await client.expect(C.Connection.Close, timeout=60)
        assert close.reply_code == 320 and "pause_minority" in close.reply_text
        _, close = await SimAmqp.connect(c, "n1")
        assert close.reply_code == 320 and "cannot reach a majority" in close.reply_text


async def test_a_memory_alarm_blocks_amqp_publishers_and_keeps_reading_consumers(tmp_path, autojump_clock):
    """RabbitMQ's use of connection.blocked: n3 passes its memory mark; an AMQP publisher on n1 is
    told connection.blocked and held (what it publishes is not confirmed), a connection that only
    consumes is read; below 90% of the mark the publisher gets connection.unblocked and its
    publishes are confirmed."""
    async with sim_cluster(tmp_path, memory_high_watermark="100MiB") as c:
        MiB = 1 << 20
        pub, ok = await SimAmqp.connect(c, "n1")
        con, ok2 = await SimAmqp.connect(c, "n2")
        for client in (pub, con):
            await client.method(1, C.Channel.Open())
            await client.expect(C.Channel.OpenOk)
        await pub.method(1, C.Queue.Declare(0, "q"))
        await pub.expect(C.Queue.DeclareOk)
        await pub.method(1, C.Confirm.Select())
        await pub.expect(C.Confirm.SelectOk)
        one = (frame.marshal(C.Basic.Publish(0, "", "q"), 1)
               + frame.marshal(header.ContentHeader(0, 1, C.Basic.Properties()), 1)
               + frame.marshal(pbody.ContentBody(b"x"), 1))
        await pub.send(one)
        await pub.expect(C.Basic.Ack)
        c.memory["n3"].used_bytes = 101 * MiB
        blocked = await pub.expect(C.Connection.Blocked)
        assert "above its high watermark" in blocked.reason
        await pub.send(one)  # held: not read, not confirmed
        with pytest.raises(trio.TooSlowError):
            await pub.expect(C.Basic.Ack, timeout=2)
        await con.method(1, C.Basic.Get(0, "q", True))  # a consumer is read meanwhile
        await con.expect(C.Basic.GetOk)
        rows = c.nodes["n1"].sessions.values()
        assert [s.protocol for s in rows] == ["AMQP 0-9-1"]
        c.memory["n3"].used_bytes = 89 * MiB
        await pub.expect(C.Connection.Unblocked)
        ack = await pub.expect(C.Basic.Ack)
        assert ack.delivery_tag == 2


def count_timer_ticks(monkeypatch) -> list:
    """Record the time of every wake of the AMQP connections' timers (each one ticks the
    protocol once)."""
    ticks = []
    real = amqp_protocol.AmqpProtocol.tick

    def tick(self, now):
        ticks.append(now)
        return real(self, now)
    monkeypatch.setattr(amqp_protocol.AmqpProtocol, "tick", tick)
    return ticks


async def test_an_idle_connection_wakes_its_timer_only_for_its_heartbeats(tmp_path, autojump_clock, monkeypatch):
    """A connection's timer sleeps until a heartbeat is due (it used to wake every second: on a
    node holding 10,000 idle connections, 10,000 wake-ups a second). With heartbeats off it does
    not wake at all; with a heartbeat of 10 s the server still sends one every 5 s of silence,
    and drops a client silent for twice the heartbeat (as RabbitMQ does: it closes the socket)."""
    ticks = count_timer_ticks(monkeypatch)
    async with sim_cluster(tmp_path) as c:
        quiet, ok = await SimAmqp.connect(c, "n1")
        assert isinstance(ok, C.Connection.OpenOk)
        await trio.sleep(0.1)
        # the handshake's steps keep its time limit: only the move to open woke the timer
        assert len(ticks) <= 1, f"{len(ticks)} timer wake-ups during the handshake"
        ticks.clear()
        await trio.sleep(120)
        assert ticks == [], f"{len(ticks)} timer wake-ups in 120 s of an idle connection"
        beating, ok = await SimAmqp.connect(c, "n1", heartbeat=10)
        assert isinstance(ok, C.Connection.OpenOk)
        t0 = trio.current_time()
        ticks.clear()
        beats = 0
        with trio.fail_after(30):
            while data := await beating.stream.receive_some(1 << 16):  # until it drops us
                beats += sum(kind == 8 for kind, _, _ in beating.reader.feed(data))
        took = trio.current_time() - t0
        assert 20 <= took <= 26 and beats >= 3, (took, beats)
        assert len(ticks) <= 8, f"{len(ticks)} timer wake-ups for a 10 s heartbeat over {took:.0f} s"


async def test_a_client_that_never_finishes_the_handshake_is_dropped_after_ten_seconds(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        stream = await c.net.host("n1").connect("n1", AMQP_PORT)
        await stream.send_all(codec.PROTOCOL_HEADER)  # then nothing: no start-ok
        t0 = trio.current_time()
        with trio.fail_after(30):
            while await stream.receive_some(1 << 16):
                pass
        assert 10 <= trio.current_time() - t0 <= 11



def _publish_frames(ch: int, exchange: str, key: str, body: bytes, mandatory=False, **props) -> bytes:
    return (frame.marshal(C.Basic.Publish(0, exchange, key, mandatory), ch)
            + frame.marshal(header.ContentHeader(0, len(body), C.Basic.Properties(**props)), ch)
            + frame.marshal(pbody.ContentBody(body), ch))


async def test_direct_reply_to_crosses_to_the_requesting_nodes_channel(tmp_path, autojump_clock):
    """An RPC client on n1 consumes amq.rabbitmq.reply-to; the server on n2 takes the request
    and publishes its reply to the rewritten reply_to; it reaches the client's channel over the
    peer link, delivered with the name it was sent to. Once the client's connection is gone, a
    mandatory reply to that name comes back to the server."""
    async with sim_cluster(tmp_path) as c:
        client, _ = await SimAmqp.connect(c, "n1")
        server, _ = await SimAmqp.connect(c, "n2")
        for conn in (client, server):
            await conn.method(1, C.Channel.Open())
            await conn.expect(C.Channel.OpenOk)
        await server.method(1, C.Queue.Declare(0, "rpc"))
        await server.expect(C.Queue.DeclareOk)
        await client.method(1, C.Basic.Consume(0, "amq.rabbitmq.reply-to", "", False, True))
        await client.expect(C.Basic.ConsumeOk)
        await client.send(_publish_frames(1, "", "rpc", b"2+2", reply_to="amq.rabbitmq.reply-to",
                                          correlation_id="c-1"))
        for _ in range(50):
            await server.method(1, C.Basic.Get(0, "rpc", True))
            got = await server.next()
            if isinstance(got, C.Basic.GetOk):
                break
            await trio.sleep(0.05)
        props = (await server.next()).properties
        await server.next()  # the body
        assert props.reply_to.startswith("amq.rabbitmq.reply-to.") and props.correlation_id == "c-1"
        await server.send(_publish_frames(1, "", props.reply_to, b"4", correlation_id="c-1"))
        deliver = await client.expect(C.Basic.Deliver)
        assert (deliver.exchange, deliver.routing_key) == ("", props.reply_to)
        assert (await client.next()).properties.correlation_id == "c-1"
        assert (await client.next()).value == b"4"
        await client.stream.aclose()
        await server.method(1, C.Confirm.Select())
        await server.expect(C.Confirm.SelectOk)
        await trio.sleep(1)  # the client's session is gone on n1
        await server.send(_publish_frames(1, "", props.reply_to, b"late", mandatory=True))
        returned = await server.expect(C.Basic.Return)
        assert returned.reply_code == 312 and returned.routing_key == props.reply_to


def _garbage_of_warren() -> dict[str, int]:
    """The objects of warren's own modules that only the cyclic collector could free, by type:
    what is found with the collector off and then collected (DEBUG_SAVEALL keeps them in
    gc.garbage to be counted)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        kinds: dict[str, int] = {}
        for obj in gc.garbage:
            module = type(obj).__module__ or ""
            if module.split(".")[0] in ("broker", "mirroring", "wire"):
                name = f"{module}.{type(obj).__qualname__}"
                kinds[name] = kinds.get(name, 0) + 1
        return kinds
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


async def test_an_ended_connection_is_freed_without_waiting_for_a_collection(tmp_path, autojump_clock):
    """A node under a flood of short connections (a fuzzer, clients that reconnect in a loop)
    must free each one as it ends. The interpreter's full cyclic collection runs rarely in a
    process with many long-lived objects, so whatever an ended connection leaves in a reference
    cycle (driver and protocol, session and its handlers, a client connection and its channels,
    a channel and its consumers) waits there, with its buffers: with the collector off, nothing
    of warren's may be left for it after connections of both front ends (and of the client
    library, as the management API uses it) open, declare, consume, publish and close."""
    async with sim_cluster(tmp_path) as c:
        async def one_round(i: int) -> None:
            async with c.client(f"c{i}", ["n1"], reconnect=False) as conn:
                ch = await conn.channel()
                await ch.queue_declare(f"q{i}")
                await ch.basic_consume(f"q{i}")
                await ch.confirm_delivery()
                await ch.basic_publish("", f"q{i}", b"x")
                assert await ch.wait_for_confirms(5)
            client, ok = await SimAmqp.connect(c, "n1")
            assert isinstance(ok, C.Connection.OpenOk)
            await client.method(1, C.Channel.Open())
            await client.expect(C.Channel.OpenOk)
            await client.method(1, C.Queue.Declare(0, f"a{i}"))
            await client.expect(C.Queue.DeclareOk)
            await client.method(1, C.Basic.Consume(0, f"a{i}"))
            await client.expect(C.Basic.ConsumeOk)
            await client.method(0, C.Connection.Close(200, "bye", 0, 0))
            await client.expect(C.Connection.CloseOk)
            await client.stream.aclose()

        await one_round(0)  # the first round's imports, caches and queues are not the point
        await trio.sleep(10)
        gc.collect()
        gc.disable()
        try:
            for i in range(1, 6):
                await one_round(i)
            await trio.sleep(10)  # every connection's tasks are over (its close handshake, timers)
            assert c.nodes["n1"].client_sockets == 0
            assert _garbage_of_warren() == {}
        finally:
            gc.enable()

"""A client's publishes and acks are one batch of input (Router.begin_input/end_input): the
queue's round runs at the end of the read, in the connection's reader task, instead of waking
the queue's task (a pass of trio's scheduler per hop). Back-pressure from a full peer link still
holds the publisher, after the run. Simulated cluster, MockClock."""

from __future__ import annotations

import pytest
import trio
from pamqp import body as pbody
from pamqp import commands as C
from pamqp import frame, header

from broker.queue_process import QueueProcess
from broker.router import Router
from broker.simulation import sim_cluster
from wire import messages as m
from tests.test_amqp_sim import SimAmqp

pytestmark = pytest.mark.timeout(60)


def record_publish_tasks(monkeypatch) -> list[str]:
    """The name of the task each round that takes a publish runs in."""
    tasks: list[str] = []
    real = QueueProcess._round

    def round_(self, now):
        if any(type(x) is m.QPublish for x in self.inbox):
            tasks.append(trio.lowlevel.current_task().name)
        return real(self, now)

    monkeypatch.setattr(QueueProcess, "_round", round_)
    return tasks


async def test_a_native_publish_runs_the_queue_round_in_the_readers_task(tmp_path, autojump_clock,
                                                                       monkeypatch):
    tasks = record_publish_tasks(monkeypatch)
    async with sim_cluster(tmp_path) as c:
        async with c.connect("n1") as conn:
            ch = await conn.channel()
            await ch.queue_declare("q")
            await ch.confirm_delivery()
            await trio.sleep(1)  # the queue's task is parked
            ch.publish_nowait("q", b"one")
            assert await ch.wait_for_confirms(timeout=10)
    assert tasks, "no publish reached the leader"
    assert not any("QueueProcess.run" in t for t in tasks), tasks


async def test_an_amqp_publish_runs_the_queue_round_in_the_readers_task(tmp_path, autojump_clock,
                                                                       monkeypatch):
    tasks = record_publish_tasks(monkeypatch)
    async with sim_cluster(tmp_path) as c:
        client, ok = await SimAmqp.connect(c, "n1")
        assert isinstance(ok, C.Connection.OpenOk)
        await client.method(1, C.Channel.Open())
        await client.expect(C.Channel.OpenOk)
        await client.method(1, C.Confirm.Select())
        await client.expect(C.Confirm.SelectOk)
        await client.method(1, C.Queue.Declare(0, "q"))
        await client.expect(C.Queue.DeclareOk)
        await trio.sleep(1)
        await client.send(frame.marshal(C.Basic.Publish(0, "", "q"), 1)
                          + frame.marshal(header.ContentHeader(0, 3, C.Basic.Properties()), 1)
                          + frame.marshal(pbody.ContentBody(b"one"), 1))
        await client.expect(C.Basic.Ack)
    assert tasks and not any("QueueProcess.run" in t for t in tasks), tasks


async def test_a_publisher_waits_for_a_full_peer_link_after_its_run(tmp_path, autojump_clock,
                                                                   monkeypatch):
    """The leader is on n2; the publisher's node finds the link to it full: the publish goes out
    (the run is not cut halfway) and the reader then waits for the link before reading more."""
    waits: list[str] = []
    full = {"on": False}
    monkeypatch.setattr(Router, "link_full", lambda self, qname: full["on"])
    real_wait = Router.wait_link_room

    async def wait_link_room(self, qname):
        waits.append(qname)
        await trio.sleep(2)  # the link drains slowly
        await real_wait(self, qname)

    monkeypatch.setattr(Router, "wait_link_room", wait_link_room)
    async with sim_cluster(tmp_path) as c:
        async with c.connect("n2") as c2:
            ch2 = await c2.channel()
            await ch2.queue_declare("far")
        async with c.connect("n1") as conn:
            ch = await conn.channel()
            await ch.confirm_delivery()
            full["on"] = True
            ch.publish_nowait("far", b"a")
            t0 = trio.current_time()
            assert await ch.wait_for_confirms(timeout=10)  # the publish was sent at once
            assert trio.current_time() - t0 < 1
            assert waits == ["far"]
            full["on"] = False
            ch.publish_nowait("far", b"b")
            # the reader is still waiting for the link: the second publish is read after it
            assert await ch.wait_for_confirms(timeout=10)
            assert trio.current_time() - t0 >= 1.9
            assert waits == ["far"]


async def test_a_batch_of_input_cannot_be_opened_twice(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        router = c.nodes["n1"].router
        router.begin_input()
        try:
            with pytest.raises(RuntimeError, match="already open"):
                router.begin_input()
        finally:
            router.end_input()
        assert router.batch is None
